//! The destinations a filter may ever route to: `allowed_destinations`, a list of CIDR blocks
//! each with optional port ranges. Static endpoints and the aggregator's endpoints outside it
//! are refused, so a poisoned snapshot (or a mistyped endpoint) cannot send prompts to the
//! proxy's admin port, a metadata address or anywhere else.
//!
//! ```
//! use kvoy_shared::allow::Allowlist;
//! let list = Allowlist::from_json(br#"[{"cidr":"10.0.0.0/8","ports":[8000,"9000-9100"]}]"#).unwrap();
//! assert!(list.check("10.1.2.3:9050".parse().unwrap()).is_ok());
//! assert!(list.check("10.1.2.3:22".parse().unwrap()).is_err());
//! assert!(list.check("169.254.169.254:8000".parse().unwrap()).is_err());
//! ```

use std::fmt;
use std::net::{IpAddr, SocketAddr};

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;
use thiserror::Error;

/// An address block: `ip/len` (IPv4 or IPv6). IPv4-mapped IPv6 addresses match IPv4 blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    network: IpAddr,
    len: u8,
}

/// A text that is not a CIDR block.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("{0:?} is not a CIDR block (`ip/len`, e.g. 10.0.0.0/8 or fd00::/8)")]
pub struct CidrError(pub String);

impl Cidr {
    /// Parses `ip/len`; a bare address is a block of one (`/32`, `/128`). Host bits must be 0.
    pub fn parse(text: &str) -> Result<Cidr, CidrError> {
        let bad = || CidrError(text.to_owned());
        let (ip, len) = match text.trim().split_once('/') {
            Some((ip, len)) => (ip, Some(len)),
            None => (text.trim(), None),
        };
        let network: IpAddr = ip.parse().map_err(|_| bad())?;
        let max = if network.is_ipv4() { 32 } else { 128 };
        let len = match len {
            None => max,
            Some(l) if !l.is_empty() && l.bytes().all(|b| b.is_ascii_digit()) => {
                l.parse::<u8>().map_err(|_| bad())?
            }
            Some(_) => return Err(bad()),
        };
        if len > max {
            return Err(bad());
        }
        let cidr = Cidr { network, len };
        if cidr.masked(network) != Some(bits(network)) {
            return Err(bad());
        }
        Ok(cidr)
    }

    /// The address bits of `ip` under this block's mask, if the families match.
    fn masked(&self, ip: IpAddr) -> Option<u128> {
        let (value, width) = match (self.network, ip.to_canonical()) {
            (IpAddr::V4(_), IpAddr::V4(a)) => (u128::from(u32::from(a)), 32),
            (IpAddr::V6(_), IpAddr::V6(a)) => (u128::from(a), 128),
            _ => return None,
        };
        let len = u32::from(self.len);
        let mask = if len == 0 {
            0
        } else {
            (u128::MAX << (width - len)) & (u128::MAX >> (128 - width))
        };
        Some(value & mask)
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        self.masked(ip) == Some(bits(self.network))
    }
}

fn bits(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u128::from(u32::from(a)),
        IpAddr::V6(a) => u128::from(a),
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.len)
    }
}

/// An inclusive port range (a single port is `a..=a`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortRange {
    pub first: u16,
    pub last: u16,
}

impl PortRange {
    /// `8000` or `"8000-8100"` (also `"8000"`); ports 1-65535, first <= last.
    pub fn parse(text: &str) -> Option<PortRange> {
        let port = |s: &str| s.trim().parse::<u16>().ok().filter(|&p| p > 0);
        let (first, last) = match text.split_once('-') {
            Some((a, b)) => (port(a)?, port(b)?),
            None => (port(text)?, port(text)?),
        };
        (first <= last).then_some(PortRange { first, last })
    }

    pub fn contains(&self, port: u16) -> bool {
        (self.first..=self.last).contains(&port)
    }
}

impl<'de> Deserialize<'de> for PortRange {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        const EXPECTED: &str = "a port (1-65535) or a range \"first-last\"";
        impl Visitor<'_> for V {
            type Value = PortRange;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(EXPECTED)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<PortRange, E> {
                u16::try_from(v)
                    .ok()
                    .and_then(|p| PortRange::parse(&p.to_string()))
                    .ok_or_else(|| E::invalid_value(de::Unexpected::Unsigned(v), &EXPECTED))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<PortRange, E> {
                Err(E::invalid_value(de::Unexpected::Signed(v), &EXPECTED))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<PortRange, E> {
                PortRange::parse(v)
                    .ok_or_else(|| E::invalid_value(de::Unexpected::Str(v), &EXPECTED))
            }
        }
        d.deserialize_any(V)
    }
}

/// One entry of `allowed_destinations` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    cidr: String,
    /// Empty: every port.
    #[serde(default)]
    ports: Vec<PortRange>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Rule {
    cidr: Cidr,
    ports: Vec<PortRange>,
}

/// Why an address is not an allowed destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Error)]
pub enum Refusal {
    #[error("its address is in no block of allowed_destinations")]
    Address,
    #[error("its port is not allowed for its address block in allowed_destinations")]
    Port,
    #[error("the pool already has max_endpoints endpoints")]
    TooMany,
}

impl Refusal {
    /// A metric-friendly label.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Address => "address",
            Refusal::Port => "port",
            Refusal::TooMany => "max_endpoints",
        }
    }
}

/// A bad `allowed_destinations`.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum AllowlistError {
    #[error("`allowed_destinations`: {0}")]
    Json(String),
    #[error("`allowed_destinations[{index}].cidr`: {source}")]
    Cidr { index: usize, source: CidrError },
    #[error("`allowed_destinations` is empty: name at least one CIDR block")]
    Empty,
}

/// The checked `allowed_destinations`; [`Allowlist::any`] when none is configured.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Allowlist {
    /// `None`: no restriction.
    rules: Option<Vec<Rule>>,
}

impl Allowlist {
    /// Allows every destination (a static pool with no `allowed_destinations`).
    pub fn any() -> Allowlist {
        Allowlist { rules: None }
    }

    /// Whether a restriction is configured.
    pub fn is_restricted(&self) -> bool {
        self.rules.is_some()
    }

    /// Parses the JSON array of `allowed_destinations`.
    pub fn from_json(bytes: &[u8]) -> Result<Allowlist, AllowlistError> {
        let raw: Vec<RawRule> =
            serde_json::from_slice(bytes).map_err(|e| AllowlistError::Json(e.to_string()))?;
        Allowlist::from_raw(raw)
    }

    fn from_raw(raw: Vec<RawRule>) -> Result<Allowlist, AllowlistError> {
        if raw.is_empty() {
            return Err(AllowlistError::Empty);
        }
        let mut rules = Vec::with_capacity(raw.len());
        for (index, r) in raw.into_iter().enumerate() {
            let cidr =
                Cidr::parse(&r.cidr).map_err(|source| AllowlistError::Cidr { index, source })?;
            rules.push(Rule {
                cidr,
                ports: r.ports,
            });
        }
        Ok(Allowlist { rules: Some(rules) })
    }

    /// Ok when `address` may be routed to; else why not.
    pub fn check(&self, address: SocketAddr) -> Result<(), Refusal> {
        let Some(rules) = &self.rules else {
            return Ok(());
        };
        let mut in_block = false;
        for r in rules.iter().filter(|r| r.cidr.contains(address.ip())) {
            in_block = true;
            if r.ports.is_empty() || r.ports.iter().any(|p| p.contains(address.port())) {
                return Ok(());
            }
        }
        Err(if in_block {
            Refusal::Port
        } else {
            Refusal::Address
        })
    }
}

/// `allowed_destinations` inside the plugin configuration (a JSON array).
#[derive(Debug)]
pub(crate) struct RawAllowlist(Vec<RawRule>);

impl<'de> Deserialize<'de> for RawAllowlist {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Vec::<RawRule>::deserialize(d).map(RawAllowlist)
    }
}

impl TryFrom<RawAllowlist> for Allowlist {
    type Error = AllowlistError;
    fn try_from(raw: RawAllowlist) -> Result<Allowlist, AllowlistError> {
        Allowlist::from_raw(raw.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn cidr_blocks() {
        let c = Cidr::parse("10.0.0.0/8").unwrap();
        assert!(c.contains("10.255.1.2".parse().unwrap()));
        assert!(!c.contains("11.0.0.1".parse().unwrap()));
        assert!(
            c.contains("::ffff:10.1.1.1".parse().unwrap()),
            "IPv4-mapped"
        );
        assert!(!c.contains("fd00::1".parse().unwrap()));
        let one = Cidr::parse("127.0.0.1").unwrap();
        assert_eq!(one.to_string(), "127.0.0.1/32");
        assert!(!one.contains("127.0.0.2".parse().unwrap()));
        let all = Cidr::parse("0.0.0.0/0").unwrap();
        assert!(all.contains("8.8.8.8".parse().unwrap()));
        let v6 = Cidr::parse("fd00::/8").unwrap();
        assert!(v6.contains("fd12::5".parse().unwrap()));
        assert!(!v6.contains("fe80::1".parse().unwrap()));
        assert!(Cidr::parse("::/0")
            .unwrap()
            .contains("::1".parse().unwrap()));
        for bad in [
            "10.0.0.1/8",
            "10.0.0.0/33",
            "10.0.0.0/",
            "10.0.0.0/+8",
            "ten/8",
            "",
            "fd00::/129",
            "10.0.0.0/8/8",
        ] {
            assert!(Cidr::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn port_ranges() {
        assert_eq!(
            PortRange::parse("8000-8100"),
            Some(PortRange {
                first: 8000,
                last: 8100
            })
        );
        assert_eq!(
            PortRange::parse("80"),
            Some(PortRange {
                first: 80,
                last: 80
            })
        );
        for bad in ["0", "9-8", "70000", "a-b", "", "-5"] {
            assert_eq!(PortRange::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn checks_blocks_and_ports() {
        let list = Allowlist::from_json(
            br#"[{"cidr":"10.0.0.0/8","ports":[8000,"8100-8200"]},{"cidr":"127.0.0.0/8"}]"#,
        )
        .unwrap();
        assert!(list.is_restricted());
        assert_eq!(list.check(addr("10.0.0.7:8000")), Ok(()));
        assert_eq!(list.check(addr("10.0.0.7:8150")), Ok(()));
        assert_eq!(list.check(addr("10.0.0.7:9901")), Err(Refusal::Port));
        assert_eq!(list.check(addr("127.0.0.1:9901")), Ok(()), "any port");
        assert_eq!(
            list.check(addr("169.254.169.254:80")),
            Err(Refusal::Address)
        );
        assert_eq!(list.check(addr("[::1]:8000")), Err(Refusal::Address));
        assert_eq!(Allowlist::any().check(addr("1.2.3.4:5")), Ok(()));
    }

    #[test]
    fn errors_name_the_field() {
        let e = Allowlist::from_json(br#"[{"cidr":"10.0.0.0/8"},{"cidr":"10.0.0.1/8"}]"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("allowed_destinations[1].cidr"), "{e}");
        let e = Allowlist::from_json(br#"[{"cidr":"10.0.0.0/8","ports":[0]}]"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("port (1-65535)"), "{e}");
        let e = Allowlist::from_json(br#"[{"cidr":"10.0.0.0/8","port":[1]}]"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `port`"), "{e}");
        assert_eq!(Allowlist::from_json(b"[]"), Err(AllowlistError::Empty));
    }
}
