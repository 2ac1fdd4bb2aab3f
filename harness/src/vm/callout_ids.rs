//! Callout tokens as Envoy hands them out, per VM: HTTP callouts, unary gRPC calls and gRPC
//! streams each have a sequence, told apart by the token's two low bits.

/// The kind of a callout token: Envoy keeps it in the two low bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CalloutKind {
    Http = 0,
    GrpcCall = 1,
    GrpcStream = 2,
}

impl CalloutKind {
    /// The kind a token belongs to (`None` for the unused `3` pattern).
    pub fn of(token: u32) -> Option<CalloutKind> {
        match token & 3 {
            0 => Some(CalloutKind::Http),
            1 => Some(CalloutKind::GrpcCall),
            2 => Some(CalloutKind::GrpcStream),
            _ => None,
        }
    }
}

/// Envoy's callout ids, per VM (proxy-wasm-cpp-host `WasmBase::nextHttpCallId`,
/// `nextGrpcCallId`, `nextGrpcStreamId`): three sequences stepping by 4 from 0, 1 and 2, so
/// HTTP tokens are 4, 8, ..., unary gRPC 5, 9, ..., gRPC streams 6, 10, ...
#[derive(Debug, Clone)]
pub(crate) struct CalloutIds {
    http: u32,
    grpc_call: u32,
    grpc_stream: u32,
}

impl Default for CalloutIds {
    fn default() -> CalloutIds {
        CalloutIds {
            http: CalloutKind::Http as u32,
            grpc_call: CalloutKind::GrpcCall as u32,
            grpc_stream: CalloutKind::GrpcStream as u32,
        }
    }
}

impl CalloutIds {
    /// The next token of a kind (never 0: the HTTP sequence skips it when it wraps).
    pub fn next(&mut self, kind: CalloutKind) -> u32 {
        let slot = match kind {
            CalloutKind::Http => &mut self.http,
            CalloutKind::GrpcCall => &mut self.grpc_call,
            CalloutKind::GrpcStream => &mut self.grpc_stream,
        };
        *slot = slot.wrapping_add(4);
        if *slot == 0 {
            *slot = 4;
        }
        *slot
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_sequences_match_envoy() {
        let mut ids = CalloutIds::default();
        assert_eq!(ids.next(CalloutKind::Http), 4);
        assert_eq!(ids.next(CalloutKind::GrpcCall), 5);
        assert_eq!(ids.next(CalloutKind::GrpcCall), 9);
        assert_eq!(ids.next(CalloutKind::GrpcStream), 6);
        assert_eq!(ids.next(CalloutKind::Http), 8);
        assert_eq!(CalloutKind::of(9), Some(CalloutKind::GrpcCall));
        assert_eq!(CalloutKind::of(6), Some(CalloutKind::GrpcStream));
        assert_eq!(CalloutKind::of(7), None);
    }
}
