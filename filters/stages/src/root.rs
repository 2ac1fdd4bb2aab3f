//! The root context of a filter that drives one stage: it configures the stage's per-VM state,
//! ticks it and hands it the answers to its HTTP calls. The separate filters are this root plus
//! their stream; the combined `kvoy` filter has a root of its own (three stages, one pass).

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use log::error;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;

/// A stage's per-VM state, shared by the root context and every stream of the VM.
pub type SharedVm<V> = Rc<RefCell<Option<V>>>;

/// What a separate filter's root needs from its stage's per-VM state.
pub trait StageVm: Sized + 'static {
    /// The filter's name, for its log lines.
    const FILTER: &'static str;
    /// Said when Envoy gives the filter no configuration; `None`: an empty one (the defaults).
    const REQUIRED: Option<&'static str> = None;
    /// What the filter goes without if Envoy refuses its tick period.
    const WITHOUT_TICKS: &'static str = "";

    /// Checks the plugin configuration and sets the VM up (`context_id`: the root context's);
    /// the error says what is wrong.
    fn configure(raw: &[u8], context_id: u32) -> Result<Self, String>;

    /// How often the VM should tick; `None`: never.
    fn tick_period(&self) -> Option<Duration> {
        None
    }

    fn on_tick(&mut self) {}

    /// The answer to the HTTP call `token` (the stage's own calls only).
    fn on_http_call_response(&mut self, _token: u32, _num_headers: usize, _body_size: usize) {}
}

/// The root context of a filter driving the stage `V`; `stream` makes the filter's HTTP
/// context for a new request (with its context id).
pub struct StageRoot<V> {
    context_id: u32,
    state: SharedVm<V>,
    stream: fn(SharedVm<V>, u32) -> Box<dyn HttpContext>,
}

impl<V: StageVm> StageRoot<V> {
    pub fn new(context_id: u32, stream: fn(SharedVm<V>, u32) -> Box<dyn HttpContext>) -> Self {
        StageRoot {
            context_id,
            state: Rc::new(RefCell::new(None)),
            stream,
        }
    }
}

impl<V: StageVm> Context for StageRoot<V> {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        if let Some(vm) = self.state.borrow_mut().as_mut() {
            vm.on_http_call_response(token_id, num_headers, body_size);
        }
    }
}

impl<V: StageVm> RootContext for StageRoot<V> {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let raw = match (self.get_plugin_configuration(), V::REQUIRED) {
            (Some(raw), _) => raw,
            (None, None) => Vec::new(),
            (None, Some(required)) => {
                error!("{}: no plugin configuration; {required}", V::FILTER);
                return false;
            }
        };
        let vm = match V::configure(&raw, self.context_id) {
            Ok(vm) => vm,
            Err(e) => {
                error!("{}: bad configuration: {e}", V::FILTER);
                return false;
            }
        };
        if let Some(period) = vm.tick_period() {
            if hostcalls::set_tick_period(period).is_err() {
                error!(
                    "{}: cannot set the tick period{}",
                    V::FILTER,
                    V::WITHOUT_TICKS
                );
            }
        }
        *self.state.borrow_mut() = Some(vm);
        true
    }

    fn on_tick(&mut self) {
        if let Some(vm) = self.state.borrow_mut().as_mut() {
            let before = vm.tick_period();
            vm.on_tick();
            // A stage's period may change with its role (the prefix stage's lease holder
            // relays every few milliseconds, the other VMs tick once per poll interval).
            match vm.tick_period() {
                Some(period) if Some(period) != before => {
                    let _ = hostcalls::set_tick_period(period);
                }
                _ => {}
            }
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some((self.stream)(self.state.clone(), context_id))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
