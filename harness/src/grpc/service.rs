//! How Envoy reads the service argument of `proxy_grpc_call` / `proxy_grpc_stream`.
//!
//! Envoy (`source/extensions/common/wasm/context.cc`, `Context::grpcCall`) first tries the
//! service argument as a serialized `envoy.config.core.v3.GrpcService`; only if that fails to
//! parse is it a cluster name, and an unknown cluster is `ParseFailure`. Protobuf accepts any
//! well-formed wire format (unknown fields are kept, the empty string is an empty message), so
//! this module checks the wire format the same way, without a protobuf dependency.

use super::GrpcTarget;

/// How Envoy reads the service argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ServiceArg {
    /// It parses as a `GrpcService`; `None` if it names no target (Envoy cannot make a client:
    /// `BadArgument`).
    Proto(Option<GrpcTarget>),
    /// It does not parse: a cluster name.
    ClusterName(String),
}

/// Reads the service argument of `proxy_grpc_call` / `proxy_grpc_stream`.
pub(crate) fn read_service(bytes: &[u8]) -> ServiceArg {
    match grpc_service_target(bytes) {
        Some(target) => ServiceArg::Proto(target),
        None => ServiceArg::ClusterName(String::from_utf8_lossy(bytes).into_owned()),
    }
}

/// `GrpcService`: `envoy_grpc` = 1, `google_grpc` = 2 (a oneof: the last one wins), and the
/// message fields `timeout` = 3, `initial_metadata` = 5, `retry_policy` = 6. `None` if the bytes
/// are not a valid message.
fn grpc_service_target(bytes: &[u8]) -> Option<Option<GrpcTarget>> {
    let mut target = None;
    for (number, field) in fields(bytes)? {
        let Field::Len(inner) = field else { continue };
        match number {
            // EnvoyGrpc.cluster_name = 1; GoogleGrpc.target_uri = 1 (proto3 strings: UTF-8).
            1 => target = Some(GrpcTarget::Cluster(string_field(inner, 1)?)),
            2 => target = Some(GrpcTarget::GoogleGrpc(string_field(inner, 1)?)),
            3 | 5 | 6 => {
                fields(inner)?;
            }
            _ => {}
        }
    }
    Some(target)
}

/// The last value of string field `wanted` in a message (empty if absent); `None` if the
/// message or the string is invalid.
fn string_field(message: &[u8], wanted: u32) -> Option<String> {
    let mut value = String::new();
    for (number, field) in fields(message)? {
        if let (true, Field::Len(bytes)) = (number == wanted, field) {
            value = String::from_utf8(bytes.to_vec()).ok()?;
        }
    }
    Some(value)
}

/// One protobuf field's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field<'a> {
    Varint,
    Fixed,
    Len(&'a [u8]),
    Group,
}

/// The top-level fields of a message, or `None` if it is not valid wire format.
fn fields(bytes: &[u8]) -> Option<Vec<(u32, Field<'_>)>> {
    let mut reader = Reader { bytes, pos: 0 };
    let mut out = Vec::new();
    while reader.pos < bytes.len() {
        let (number, field) = reader.field(0)?;
        out.push((number, field));
    }
    Some(out)
}

/// Nesting limit for groups (protobuf's default recursion limit is 100).
const MAX_DEPTH: u32 = 100;

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn varint(&mut self) -> Option<u64> {
        let mut value = 0u64;
        for shift in (0..70).step_by(7) {
            let byte = *self.bytes.get(self.pos)?;
            self.pos += 1;
            value |= u64::from(byte & 0x7f).checked_shl(shift).unwrap_or(0);
            if byte & 0x80 == 0 {
                return Some(value);
            }
        }
        None
    }

    fn take(&mut self, len: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(len)?;
        let slice = self.bytes.get(self.pos..end)?;
        self.pos = end;
        Some(slice)
    }

    /// One field; an end-group tag is an error here (it only closes a group).
    fn field(&mut self, depth: u32) -> Option<(u32, Field<'a>)> {
        let key = self.varint()?;
        let number = u32::try_from(key >> 3).ok().filter(|n| *n != 0)?;
        let field = match key & 7 {
            0 => {
                self.varint()?;
                Field::Varint
            }
            1 => {
                self.take(8)?;
                Field::Fixed
            }
            2 => {
                let len = usize::try_from(self.varint()?).ok()?;
                Field::Len(self.take(len)?)
            }
            3 => {
                self.group(number, depth + 1)?;
                Field::Group
            }
            5 => {
                self.take(4)?;
                Field::Fixed
            }
            _ => return None,
        };
        Some((number, field))
    }

    /// Skips a group's fields up to its matching end tag.
    fn group(&mut self, number: u32, depth: u32) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        loop {
            let start = self.pos;
            let key = self.varint()?;
            if key & 7 == 4 {
                return (key >> 3 == u64::from(number)).then_some(());
            }
            self.pos = start;
            self.field(depth)?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn envoy_grpc(cluster: &str) -> Vec<u8> {
        let mut inner = vec![0x0a, cluster.len() as u8];
        inner.extend_from_slice(cluster.as_bytes());
        let mut out = vec![0x0a, inner.len() as u8];
        out.extend(inner);
        out
    }

    #[test]
    fn cluster_names_do_not_parse_as_protos() {
        for name in ["scorer", "agg", "outbound|9000||ext-proc.svc", "cluster_0"] {
            assert_eq!(
                read_service(name.as_bytes()),
                ServiceArg::ClusterName(name.into()),
                "{name}"
            );
        }
    }

    #[test]
    fn protos_name_their_target() {
        assert_eq!(
            read_service(&envoy_grpc("ext")),
            ServiceArg::Proto(Some(GrpcTarget::Cluster("ext".into())))
        );
        // google_grpc { target_uri: "dns:x" } plus a timeout { seconds: 1 }.
        let google = [
            0x12, 0x07, 0x0a, 0x05, b'd', b'n', b's', b':', b'x', 0x1a, 0x02, 0x08, 0x01,
        ];
        assert_eq!(
            read_service(&google),
            ServiceArg::Proto(Some(GrpcTarget::GoogleGrpc("dns:x".into())))
        );
        // The empty string is an empty GrpcService, as for protobuf; an unknown field too.
        assert_eq!(read_service(b""), ServiceArg::Proto(None));
        assert_eq!(read_service(&[0x20, 0x01]), ServiceArg::Proto(None));
        // A group that closes properly is valid wire format.
        assert_eq!(
            read_service(&[0x23, 0x08, 0x01, 0x24]),
            ServiceArg::Proto(None)
        );
        // Truncated or mismatched: a name.
        assert!(matches!(
            read_service(&[0x0a, 0x05, 0x0a]),
            ServiceArg::ClusterName(_)
        ));
        assert!(matches!(
            read_service(&[0x23, 0x2c]),
            ServiceArg::ClusterName(_)
        ));
    }
}
