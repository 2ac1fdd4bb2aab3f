//! One VM: a wasmtime store and instance of the filter, started the way Envoy starts a worker's
//! VM, with a wrapper that turns guest traps into typed errors.

pub(crate) mod callout_ids;
pub(crate) mod counts;
pub(crate) mod host;
pub(crate) mod state;

use std::sync::Arc;

use wasmtime::{CallHook, Instance, Store, TypedFunc, WasmParams, WasmResults};

use crate::abi::wasi::ProcExit;
use crate::error::{describe, Error, Result};
use crate::http::callouts::{HttpCall, HttpResponse};
use crate::plugin::shared::Shared;
use crate::types::{Action, Status};
use crate::vm::host::HostInner;
use crate::vm::state::VmState;

type Func<P, R> = Option<TypedFunc<P, R>>;

/// The guest's exported callbacks; a missing one behaves as Envoy's default (`Continue`, `true`).
pub(crate) struct Exports {
    initialize: Func<(), ()>,
    start: Func<(), ()>,
    pub context_create: Func<(u32, u32), ()>,
    vm_start: Func<(u32, u32), u32>,
    configure: Func<(u32, u32), u32>,
    tick: Func<u32, ()>,
    queue_ready: Func<(u32, u32), ()>,
    pub request_headers: Func<(u32, u32, u32), u32>,
    pub request_body: Func<(u32, u32, u32), u32>,
    pub request_trailers: Func<(u32, u32), u32>,
    pub response_headers: Func<(u32, u32, u32), u32>,
    pub response_body: Func<(u32, u32, u32), u32>,
    pub response_trailers: Func<(u32, u32), u32>,
    pub done: Func<u32, u32>,
    pub log: Func<u32, ()>,
    pub delete: Func<u32, ()>,
    http_call_response: Func<(u32, u32, u32, u32, u32), ()>,
    pub grpc_initial_metadata: Func<(u32, u32, u32), ()>,
    pub grpc_receive: Func<(u32, u32, u32), ()>,
    pub grpc_trailing_metadata: Func<(u32, u32, u32), ()>,
    pub grpc_close: Func<(u32, u32, u32), ()>,
    pub new_connection: Func<u32, u32>,
    pub downstream_data: Func<(u32, u32, u32), u32>,
    pub upstream_data: Func<(u32, u32, u32), u32>,
    pub downstream_close: Func<(u32, u32), ()>,
    pub upstream_close: Func<(u32, u32), ()>,
    pub foreign_function: Func<(u32, u32, u32), ()>,
}

fn typed<P: WasmParams, R: WasmResults>(
    instance: &Instance,
    store: &mut Store<VmState>,
    name: &'static str,
) -> Result<Func<P, R>> {
    let Some(func) = instance.get_func(&mut *store, name) else {
        return Ok(None);
    };
    func.typed(&*store).map(Some).map_err(|e| Error::BadExport {
        name,
        message: describe(&e),
    })
}

impl Exports {
    fn new(instance: &Instance, store: &mut Store<VmState>) -> Result<Exports> {
        Ok(Exports {
            initialize: typed(instance, store, "_initialize")?,
            start: typed(instance, store, "_start")?,
            context_create: typed(instance, store, "proxy_on_context_create")?,
            vm_start: typed(instance, store, "proxy_on_vm_start")?,
            configure: typed(instance, store, "proxy_on_configure")?,
            tick: typed(instance, store, "proxy_on_tick")?,
            queue_ready: typed(instance, store, "proxy_on_queue_ready")?,
            request_headers: typed(instance, store, "proxy_on_request_headers")?,
            request_body: typed(instance, store, "proxy_on_request_body")?,
            request_trailers: typed(instance, store, "proxy_on_request_trailers")?,
            response_headers: typed(instance, store, "proxy_on_response_headers")?,
            response_body: typed(instance, store, "proxy_on_response_body")?,
            response_trailers: typed(instance, store, "proxy_on_response_trailers")?,
            done: typed(instance, store, "proxy_on_done")?,
            log: typed(instance, store, "proxy_on_log")?,
            delete: typed(instance, store, "proxy_on_delete")?,
            http_call_response: typed(instance, store, "proxy_on_http_call_response")?,
            grpc_initial_metadata: typed(
                instance,
                store,
                "proxy_on_grpc_receive_initial_metadata",
            )?,
            grpc_receive: typed(instance, store, "proxy_on_grpc_receive")?,
            grpc_trailing_metadata: typed(
                instance,
                store,
                "proxy_on_grpc_receive_trailing_metadata",
            )?,
            grpc_close: typed(instance, store, "proxy_on_grpc_close")?,
            new_connection: typed(instance, store, "proxy_on_new_connection")?,
            downstream_data: typed(instance, store, "proxy_on_downstream_data")?,
            upstream_data: typed(instance, store, "proxy_on_upstream_data")?,
            downstream_close: typed(instance, store, "proxy_on_downstream_connection_close")?,
            upstream_close: typed(instance, store, "proxy_on_upstream_connection_close")?,
            foreign_function: typed(instance, store, "proxy_on_foreign_function")?,
        })
    }
}

/// A started VM.
pub(crate) struct VmInstance {
    pub store: Store<VmState>,
    pub exports: Exports,
    pub failed: bool,
    next_context_id: u32,
}

/// Calls a guest export for `context`. `Ok(None)` if the guest does not export it. A trap or
/// `proc_exit` marks the VM failed (as Envoy does) and becomes a typed error carrying the
/// warning-or-worse lines the guest logged during the call (a Rust panic message among them).
pub(crate) fn invoke<P: WasmParams, R: WasmResults>(
    store: &mut Store<VmState>,
    failed: &mut bool,
    call: &'static str,
    func: Option<&TypedFunc<P, R>>,
    context: u32,
    args: P,
) -> Result<Option<R>> {
    let vm = store.data().vm;
    if *failed {
        return Err(Error::VmFailed { vm });
    }
    let Some(func) = func else {
        return Ok(None);
    };
    let state = store.data_mut();
    state.effective = context;
    state.call_log.clear();
    let result = func.call(&mut *store, args);
    store.data_mut().flush_output();
    match result {
        Ok(value) => Ok(Some(value)),
        Err(error) => {
            *failed = true;
            let guest_log = std::mem::take(&mut store.data_mut().call_log);
            Err(match error.downcast_ref::<ProcExit>() {
                Some(ProcExit(code)) => Error::ProcExit {
                    vm,
                    call,
                    code: *code,
                    guest_log,
                },
                None => Error::Trap {
                    vm,
                    call,
                    message: describe(&error),
                    guest_log,
                },
            })
        }
    }
}

/// Decodes a callback's action.
pub(crate) fn action(vm: usize, call: &'static str, raw: Option<u32>) -> Result<Action> {
    let raw = raw.unwrap_or(Action::Continue as u32);
    Action::from_raw(raw).ok_or(Error::BadAction {
        vm,
        call,
        value: raw,
    })
}

impl VmInstance {
    /// Instantiates the module and starts it like Envoy: `_initialize` (WASI reactor) if
    /// exported, then `proxy_on_context_create(root, 0)`, `proxy_on_vm_start(root,
    /// vm_config_size)` and `proxy_on_configure(root, plugin_config_size)`; a false return is an
    /// error, like a trap.
    pub fn start(host: &HostInner, shared: Arc<Shared>, vm: usize) -> Result<VmInstance> {
        let mut store = Store::new(host.module.engine(), VmState::new(vm, shared));
        store.call_hook(|mut store, hook| {
            let counts = &mut store.data_mut().counts;
            // Host calls are counted where each import is served (`note_host_call`): this
            // hook also fires for wasmtime's own libcalls (`memory.grow`, ...), which are no
            // crossing into the proxy.
            match hook {
                CallHook::CallingWasm => counts.vm_entries += 1,
                CallHook::CallingHost
                | CallHook::ReturningFromHost
                | CallHook::ReturningFromWasm => {}
            }
            Ok(())
        });
        let instance = host
            .pre
            .instantiate(&mut store)
            .map_err(|e| Error::Instantiate {
                vm,
                message: describe(&e),
            })?;
        let memory = instance
            .get_memory(&mut store, "memory")
            .ok_or(Error::NoMemory)?;
        let allocate = match typed(&instance, &mut store, "proxy_on_memory_allocate")? {
            Some(allocate) => allocate,
            None => typed(&instance, &mut store, "malloc")?.ok_or(Error::NoAllocator)?,
        };
        let exports = Exports::new(&instance, &mut store)?;
        let state = store.data_mut();
        state.memory = Some(memory);
        state.allocate = Some(allocate);
        let mut instance = VmInstance {
            store,
            exports,
            failed: false,
            next_context_id: 2,
        };
        instance.boot()?;
        Ok(instance)
    }

    fn boot(&mut self) -> Result<()> {
        let vm = self.vm();
        let root = self.root_id();
        let init = self.exports.initialize.as_ref();
        if init.is_some() {
            invoke(
                &mut self.store,
                &mut self.failed,
                "_initialize",
                init,
                root,
                (),
            )?;
        } else {
            let start = self.exports.start.as_ref();
            invoke(&mut self.store, &mut self.failed, "_start", start, root, ())?;
        }
        let create = self.exports.context_create.as_ref();
        invoke(
            &mut self.store,
            &mut self.failed,
            "proxy_on_context_create",
            create,
            root,
            (root, 0),
        )?;

        let config = &self.store.data().shared.config;
        let vm_config_size = size_u32(config.vm_configuration.len());
        let plugin_config_size = size_u32(config.configuration.len());
        let call = "proxy_on_vm_start";
        let ok = invoke(
            &mut self.store,
            &mut self.failed,
            call,
            self.exports.vm_start.as_ref(),
            root,
            (root, vm_config_size),
        )?;
        self.check_accepted(vm, call, ok)?;

        let call = "proxy_on_configure";
        self.store.data_mut().configuring = true;
        let ok = invoke(
            &mut self.store,
            &mut self.failed,
            call,
            self.exports.configure.as_ref(),
            root,
            (root, plugin_config_size),
        );
        self.store.data_mut().configuring = false;
        self.check_accepted(vm, call, ok?)?;
        self.after_call()
    }

    fn check_accepted(&mut self, vm: usize, call: &'static str, ok: Option<u32>) -> Result<()> {
        if ok == Some(0) {
            self.failed = true;
            let guest_log = std::mem::take(&mut self.store.data_mut().call_log);
            return Err(Error::Rejected {
                vm,
                call,
                guest_log,
            });
        }
        Ok(())
    }

    pub fn vm(&self) -> usize {
        self.store.data().vm
    }

    pub fn root_id(&self) -> u32 {
        self.store.data().root_id
    }

    /// A fresh context id for a stream (per VM, like Envoy).
    pub fn next_context_id(&mut self) -> u32 {
        let id = self.next_context_id;
        self.next_context_id = self.next_context_id.wrapping_add(1).max(2);
        id
    }

    /// `proxy_on_tick` on the root context.
    pub fn tick(&mut self) -> Result<()> {
        let root = self.root_id();
        invoke(
            &mut self.store,
            &mut self.failed,
            "proxy_on_tick",
            self.exports.tick.as_ref(),
            root,
            root,
        )?;
        self.after_call()
    }

    /// `proxy_on_foreign_function(root, function_id, arguments)` on the root context, with
    /// `arguments` readable as the `CallData` buffer during the call (Envoy's
    /// `onForeignFunction`; no built-in Envoy extension calls it, hosts and their extensions
    /// may). A guest without the export ignores it, as Envoy's null function does.
    pub fn foreign_function(&mut self, function_id: u32, arguments: &[u8]) -> Result<()> {
        let root = self.root_id();
        let size = u32::try_from(arguments.len()).unwrap_or(u32::MAX);
        self.store.data_mut().call_data = Some(arguments.to_vec());
        let result = invoke(
            &mut self.store,
            &mut self.failed,
            "proxy_on_foreign_function",
            self.exports.foreign_function.as_ref(),
            root,
            (root, function_id, size),
        );
        self.store.data_mut().call_data = None;
        result?;
        self.after_call()
    }

    /// `proxy_on_queue_ready` on a root context.
    pub fn queue_ready(&mut self, root_context_id: u32, token: u32) -> Result<()> {
        let func = self.exports.queue_ready.as_ref();
        invoke(
            &mut self.store,
            &mut self.failed,
            "proxy_on_queue_ready",
            func,
            root_context_id,
            (root_context_id, token),
        )?;
        self.after_call()
    }

    /// Delivers a callout's response (`None`: the call failed, as on a reset) to the context that
    /// made it. During the callback the response maps and body are readable and
    /// `proxy_get_status` reports the outcome.
    pub fn http_call_response(
        &mut self,
        call: &HttpCall,
        response: Option<HttpResponse>,
    ) -> Result<()> {
        let vm = self.vm();
        if !self.store.data().is_live_context(call.context_id) {
            return Err(Error::UnknownHttpCall {
                vm,
                token: call.token,
            });
        }
        let (headers, body, trailers) = response.as_ref().map_or((0, 0, 0), |r| {
            (
                size_u32(r.headers.len()),
                size_u32(r.body.len()),
                size_u32(r.trailers.len()),
            )
        });
        let state = self.store.data_mut();
        state.call_status = match response {
            Some(_) => (Status::Ok as u32, String::new()),
            None => (Status::BrokenConnection as u32, "reset".to_owned()),
        };
        state.http_response = response;
        let func = self.exports.http_call_response.as_ref();
        let args = (call.context_id, call.token, headers, body, trailers);
        let result = invoke(
            &mut self.store,
            &mut self.failed,
            "proxy_on_http_call_response",
            func,
            call.context_id,
            args,
        );
        let state = self.store.data_mut();
        state.http_response = None;
        state.call_status = (Status::Ok as u32, String::new());
        result?;
        self.after_call()
    }

    /// Applies what the guest deferred to after its call: local replies, and a connection's
    /// continue or close.
    pub fn after_call(&mut self) -> Result<()> {
        while let Some(context) = self.store.data_mut().local_replies.pop() {
            self.apply_local_reply(context)?;
        }
        self.apply_connection_actions()
    }
}

/// Sizes handed to the guest are 32-bit.
pub(crate) fn size_u32(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}
