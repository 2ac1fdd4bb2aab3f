//! One VM: a wasmtime store and instance of the filter, started the way Envoy starts a worker's
//! VM, with a wrapper that turns guest traps into typed errors.

pub(crate) mod callout_ids;
pub(crate) mod counts;
pub(crate) mod exports;
pub(crate) mod host;
pub(crate) mod state;

use std::sync::Arc;

use wasmtime::{CallHook, Store, WasmParams, WasmResults};

use crate::abi::wasi::ProcExit;
use crate::error::{describe, Error, Result};
use crate::plugin::shared::Shared;
use crate::types::Action;
use exports::{Export, Exports, Pick};
use host::HostInner;
use state::VmState;

/// A started VM.
pub(crate) struct VmInstance {
    pub store: Store<VmState>,
    pub exports: Exports,
    pub failed: bool,
    next_context_id: u32,
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
        let allocate = match Export::load(&instance, &mut store, "proxy_on_memory_allocate")?.func {
            Some(allocate) => allocate,
            None => Export::load(&instance, &mut store, "malloc")?
                .func
                .ok_or(Error::NoAllocator)?,
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
        let root = self.root_id();
        if self.exports.initialize.func.is_some() {
            self.call(|e| &e.initialize, root, ())?;
        } else {
            self.call(|e| &e.start, root, ())?;
        }
        self.call(|e| &e.context_create, root, (root, 0))?;

        let config = &self.store.data().shared.config;
        let vm_config_size = size_u32(config.vm_configuration.len());
        let plugin_config_size = size_u32(config.configuration.len());
        let ok = self.call(|e| &e.vm_start, root, (root, vm_config_size))?;
        self.check_accepted(self.exports.vm_start.name, ok)?;

        self.store.data_mut().configuring = true;
        let ok = self.call(|e| &e.configure, root, (root, plugin_config_size));
        self.store.data_mut().configuring = false;
        self.check_accepted(self.exports.configure.name, ok?)?;
        self.after_call()
    }

    fn check_accepted(&mut self, call: &'static str, ok: Option<u32>) -> Result<()> {
        if ok == Some(0) {
            self.failed = true;
            let guest_log = std::mem::take(&mut self.store.data_mut().call_log);
            return Err(Error::Rejected {
                vm: self.vm(),
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

    /// Calls a guest export for `context`. `Ok(None)` if the guest does not export it. A trap
    /// or `proc_exit` marks the VM failed (as Envoy does) and becomes a typed error carrying
    /// the warning-or-worse lines the guest logged during the call (a Rust panic message among
    /// them).
    pub(crate) fn call<P: WasmParams, R: WasmResults>(
        &mut self,
        pick: Pick<P, R>,
        context: u32,
        args: P,
    ) -> Result<Option<R>> {
        let export = pick(&self.exports);
        let call = export.name;
        let store = &mut self.store;
        let vm = store.data().vm;
        if self.failed {
            return Err(Error::VmFailed { vm });
        }
        let Some(func) = export.func.as_ref() else {
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
                self.failed = true;
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

    /// Calls a filter callback and decodes the action it returns (a missing export continues).
    pub(crate) fn call_action<P: WasmParams>(
        &mut self,
        pick: Pick<P, u32>,
        context: u32,
        args: P,
    ) -> Result<Action> {
        let raw = self
            .call(pick, context, args)?
            .unwrap_or(Action::Continue as u32);
        Action::from_raw(raw).ok_or(Error::BadAction {
            vm: self.vm(),
            call: pick(&self.exports).name,
            value: raw,
        })
    }

    /// `proxy_on_context_create(context, root)`.
    pub(crate) fn create_context(&mut self, context: u32) -> Result<()> {
        let root = self.root_id();
        self.call(|e| &e.context_create, context, (context, root))?;
        Ok(())
    }

    /// `proxy_on_tick` on the root context.
    pub fn tick(&mut self) -> Result<()> {
        let root = self.root_id();
        self.call(|e| &e.tick, root, root)?;
        self.after_call()
    }

    /// `proxy_on_foreign_function(root, function_id, arguments)` on the root context, with
    /// `arguments` readable as the `CallData` buffer during the call (Envoy's
    /// `onForeignFunction`; no built-in Envoy extension calls it, hosts and their extensions
    /// may). A guest without the export ignores it, as Envoy's null function does.
    pub fn foreign_function(&mut self, function_id: u32, arguments: &[u8]) -> Result<()> {
        let root = self.root_id();
        let size = size_u32(arguments.len());
        self.store.data_mut().call_data = Some(arguments.to_vec());
        let result = self.call(|e| &e.foreign_function, root, (root, function_id, size));
        self.store.data_mut().call_data = None;
        result?;
        self.after_call()
    }

    /// `proxy_on_queue_ready` on a root context.
    pub fn queue_ready(&mut self, root_context_id: u32, token: u32) -> Result<()> {
        self.call(
            |e| &e.queue_ready,
            root_context_id,
            (root_context_id, token),
        )?;
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
