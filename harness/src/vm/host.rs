//! The compiled filter module, shared by every plugin and VM started from it.

use std::path::Path;
use std::sync::Arc;

use wasmtime::{Config, Engine, ExternType, InstancePre, Linker, Module};

use crate::abi;
use crate::error::{describe, Error, Result};
use crate::plugin::PluginBuilder;
use crate::vm::state::VmState;

/// ABI version markers the harness accepts (the Rust SDK 0.2.x exports the first).
const ABI_EXPORTS: [&str; 2] = ["proxy_abi_version_0_2_1", "proxy_abi_version_0_2_0"];

/// A filter module compiled once (wasmtime `Engine` + `Module` + linked imports); cheap to
/// clone, and each [`Host::plugin`] instantiates it again.
#[derive(Clone)]
pub struct Host {
    inner: Arc<HostInner>,
}

pub(crate) struct HostInner {
    pub module: Module,
    pub pre: InstancePre<VmState>,
}

impl Host {
    /// Reads and compiles a `.wasm` file.
    pub fn load(path: impl AsRef<Path>) -> Result<Host> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| Error::Read {
            path: path.to_owned(),
            source,
        })?;
        Host::from_bytes(&bytes)
    }

    /// Compiles a module from its binary form.
    pub fn from_bytes(bytes: &[u8]) -> Result<Host> {
        let engine = Engine::new(&Config::new()).map_err(|e| Error::Compile(describe(&e)))?;
        let module = Module::new(&engine, bytes).map_err(|e| Error::Compile(describe(&e)))?;
        check_exports(&module)?;
        let mut linker = Linker::new(&engine);
        abi::add_to_linker(&mut linker).map_err(|e| Error::Compile(describe(&e)))?;
        linker
            .define_unknown_imports_as_traps(&module)
            .map_err(|e| Error::Compile(describe(&e)))?;
        let pre = linker
            .instantiate_pre(&module)
            .map_err(|e| Error::Compile(describe(&e)))?;
        Ok(Host {
            inner: Arc::new(HostInner { module, pre }),
        })
    }

    /// Starts configuring a plugin (a set of VMs running this module).
    pub fn plugin(&self) -> PluginBuilder {
        PluginBuilder::new(self.inner.clone())
    }

    /// The module's imports as `module::name`, e.g. to check which WASI calls a filter needs.
    pub fn imports(&self) -> Vec<String> {
        self.inner
            .module
            .imports()
            .map(|import| format!("{}::{}", import.module(), import.name()))
            .collect()
    }
}

fn check_exports(module: &Module) -> Result<()> {
    if !ABI_EXPORTS
        .iter()
        .any(|name| module.get_export(name).is_some())
    {
        return Err(Error::UnsupportedAbi(
            "proxy_abi_version_0_2_1, proxy_abi_version_0_2_0",
        ));
    }
    if !matches!(module.get_export("memory"), Some(ExternType::Memory(_))) {
        return Err(Error::NoMemory);
    }
    if module.get_export("proxy_on_memory_allocate").is_none()
        && module.get_export("malloc").is_none()
    {
        return Err(Error::NoAllocator);
    }
    Ok(())
}
