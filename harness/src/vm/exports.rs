//! The guest's exported callbacks, looked up once per VM with the types the ABI gives them.

use wasmtime::{Instance, Store, TypedFunc, WasmParams, WasmResults};

use super::state::VmState;
use crate::error::{describe, Error, Result};

/// One export: its name (for errors) and the function, if the guest has it.
pub(crate) struct Export<P, R> {
    pub name: &'static str,
    pub func: Option<TypedFunc<P, R>>,
}

impl<P: WasmParams, R: WasmResults> Export<P, R> {
    /// Looks `name` up; a missing export is `None`, one of another type an error.
    pub fn load(
        instance: &Instance,
        store: &mut Store<VmState>,
        name: &'static str,
    ) -> Result<Self> {
        let func = match instance.get_func(&mut *store, name) {
            None => None,
            Some(func) => Some(func.typed(&*store).map_err(|e| Error::BadExport {
                name,
                message: describe(&e),
            })?),
        };
        Ok(Export { name, func })
    }
}

/// Picks one export of [`Exports`], for [`super::VmInstance::call`].
pub(crate) type Pick<P, R> = fn(&Exports) -> &Export<P, R>;

/// Declares [`Exports`] from one table: field, parameters, result and export name.
macro_rules! exports {
    ($($field:ident: $params:ty => $results:ty = $name:literal,)*) => {
        /// The guest's exported callbacks; a missing one behaves as Envoy's default
        /// (`Continue`, `true`).
        pub(crate) struct Exports {
            $(pub $field: Export<$params, $results>,)*
        }

        impl Exports {
            pub fn new(instance: &Instance, store: &mut Store<VmState>) -> Result<Exports> {
                Ok(Exports {
                    $($field: Export::load(instance, store, $name)?,)*
                })
            }
        }
    };
}

exports! {
    initialize: () => () = "_initialize",
    start: () => () = "_start",
    context_create: (u32, u32) => () = "proxy_on_context_create",
    vm_start: (u32, u32) => u32 = "proxy_on_vm_start",
    configure: (u32, u32) => u32 = "proxy_on_configure",
    tick: u32 => () = "proxy_on_tick",
    queue_ready: (u32, u32) => () = "proxy_on_queue_ready",
    request_headers: (u32, u32, u32) => u32 = "proxy_on_request_headers",
    request_body: (u32, u32, u32) => u32 = "proxy_on_request_body",
    request_trailers: (u32, u32) => u32 = "proxy_on_request_trailers",
    response_headers: (u32, u32, u32) => u32 = "proxy_on_response_headers",
    response_body: (u32, u32, u32) => u32 = "proxy_on_response_body",
    response_trailers: (u32, u32) => u32 = "proxy_on_response_trailers",
    done: u32 => u32 = "proxy_on_done",
    log: u32 => () = "proxy_on_log",
    delete: u32 => () = "proxy_on_delete",
    http_call_response: (u32, u32, u32, u32, u32) => () = "proxy_on_http_call_response",
    grpc_initial_metadata: (u32, u32, u32) => () = "proxy_on_grpc_receive_initial_metadata",
    grpc_receive: (u32, u32, u32) => () = "proxy_on_grpc_receive",
    grpc_trailing_metadata: (u32, u32, u32) => () = "proxy_on_grpc_receive_trailing_metadata",
    grpc_close: (u32, u32, u32) => () = "proxy_on_grpc_close",
    new_connection: u32 => u32 = "proxy_on_new_connection",
    downstream_data: (u32, u32, u32) => u32 = "proxy_on_downstream_data",
    upstream_data: (u32, u32, u32) => u32 = "proxy_on_upstream_data",
    downstream_close: (u32, u32) => () = "proxy_on_downstream_connection_close",
    upstream_close: (u32, u32) => () = "proxy_on_upstream_connection_close",
    foreign_function: (u32, u32, u32) => () = "proxy_on_foreign_function",
}
