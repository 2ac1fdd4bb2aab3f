//! The proxy-wasm ABI 0.2.1 enums, with the numbers the SDK's `types.rs` and the spec use.

/// Declares an ABI enum with its numbers and `from_raw`, which decodes a guest-supplied value
/// (`None` for a number the ABI does not define, or the Rust SDK never sends).
macro_rules! abi_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident { $($(#[$variant_meta:meta])* $variant:ident = $value:literal,)* }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u32)]
        pub enum $name {
            $($(#[$variant_meta])* $variant = $value,)*
        }

        impl $name {
            /// Decodes a guest-supplied value; `None` for a number the ABI does not define.
            pub fn from_raw(value: u32) -> Option<$name> {
                match value {
                    $($value => Some($name::$variant),)*
                    _ => None,
                }
            }
        }
    };
}

abi_enum! {
    /// A host call's result code (`WasmResult` in Envoy).
    pub enum Status {
        Ok = 0,
        NotFound = 1,
        BadArgument = 2,
        SerializationFailure = 3,
        ParseFailure = 4,
        BadExpression = 5,
        InvalidMemoryAccess = 6,
        Empty = 7,
        CasMismatch = 8,
        ResultMismatch = 9,
        InternalFailure = 10,
        BrokenConnection = 11,
        Unimplemented = 12,
    }
}

abi_enum! {
    /// What a filter callback asks the host to do with the stream.
    pub enum Action {
        Continue = 0,
        Pause = 1,
    }
}

abi_enum! {
    /// Log levels of `proxy_log` and `proxy_get_log_level`.
    #[derive(PartialOrd, Ord)]
    pub enum LogLevel {
        Trace = 0,
        Debug = 1,
        Info = 2,
        Warn = 3,
        Error = 4,
        Critical = 5,
    }
}

impl LogLevel {
    /// Lower-case name, as Envoy prints it.
    pub fn as_str(self) -> &'static str {
        match self {
            LogLevel::Trace => "trace",
            LogLevel::Debug => "debug",
            LogLevel::Info => "info",
            LogLevel::Warn => "warn",
            LogLevel::Error => "error",
            LogLevel::Critical => "critical",
        }
    }
}

abi_enum! {
    /// Buffers readable with `proxy_get_buffer_bytes`.
    pub enum BufferType {
        HttpRequestBody = 0,
        HttpResponseBody = 1,
        DownstreamData = 2,
        UpstreamData = 3,
        HttpCallResponseBody = 4,
        GrpcReceiveBuffer = 5,
        VmConfiguration = 6,
        PluginConfiguration = 7,
        CallData = 8,
    }
}

abi_enum! {
    /// Header maps addressable with the `proxy_*_header_map_*` calls.
    pub enum MapType {
        HttpRequestHeaders = 0,
        HttpRequestTrailers = 1,
        HttpResponseHeaders = 2,
        HttpResponseTrailers = 3,
        GrpcReceiveInitialMetadata = 4,
        GrpcReceiveTrailingMetadata = 5,
        HttpCallResponseHeaders = 6,
        HttpCallResponseTrailers = 7,
    }
}

abi_enum! {
    /// Metric kinds of `proxy_define_metric`.
    pub enum MetricType {
        Counter = 0,
        Gauge = 1,
        Histogram = 2,
    }
}

abi_enum! {
    /// Streams named by `proxy_continue_stream` and `proxy_close_stream`.
    pub enum StreamType {
        HttpRequest = 0,
        HttpResponse = 1,
        Downstream = 2,
        Upstream = 3,
    }
}

abi_enum! {
    /// How a connection closed, as `proxy_on_*_connection_close` reports it (the SDK's
    /// `PeerType`).
    pub enum CloseType {
        /// Envoy's upstream close, seen only as the end of the upstream data.
        Unknown = 0,
        /// Envoy closed the connection (e.g. the filter's `proxy_close_stream`).
        Local = 1,
        /// The peer closed it.
        Remote = 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_match_the_sdk() {
        assert_eq!(Status::Ok as u32, 0);
        assert_eq!(Status::NotFound as u32, 1);
        assert_eq!(Status::BadArgument as u32, 2);
        assert_eq!(Status::SerializationFailure as u32, 3);
        assert_eq!(Status::ParseFailure as u32, 4);
        assert_eq!(Status::Empty as u32, 7);
        assert_eq!(Status::CasMismatch as u32, 8);
        assert_eq!(Status::InternalFailure as u32, 10);
        assert_eq!(Action::from_raw(0), Some(Action::Continue));
        assert_eq!(Action::from_raw(1), Some(Action::Pause));
        assert_eq!(Action::from_raw(2), None);
        assert_eq!(
            BufferType::from_raw(7),
            Some(BufferType::PluginConfiguration)
        );
        assert_eq!(MapType::from_raw(6), Some(MapType::HttpCallResponseHeaders));
        assert_eq!(LogLevel::from_raw(5), Some(LogLevel::Critical));
        assert_eq!(LogLevel::from_raw(6), None);
    }
}
