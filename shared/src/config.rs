//! What the configurations' checks share: the error for a value outside its allowed range, with
//! a message that names the field, what it must be and what it got; and the checks of a
//! configured endpoint list's addresses (the filters' static pool and the aggregator's
//! endpoints).

use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt::Display;
use std::net::SocketAddr;
use std::ops::RangeInclusive;

use thiserror::Error;

use crate::MAX_ENDPOINTS;

/// A configuration value outside its allowed range.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[error("`{field}` must be {expected}, got {value}")]
pub struct OutOfRange {
    pub field: &'static str,
    pub expected: Cow<'static, str>,
    pub value: String,
}

/// `field` got `value`, which is not `expected`, as any configuration error that can hold it.
pub fn out_of_range<E: From<OutOfRange>>(
    field: &'static str,
    expected: &'static str,
    value: impl ToString,
) -> E {
    E::from(OutOfRange {
        field,
        expected: Cow::Borrowed(expected),
        value: value.to_string(),
    })
}

/// `value` if `range` holds it; else the error naming `field`, the range (`within lo..=hi`, so
/// the message cannot drift from the check) and `value`. A NaN is never within.
pub fn within<T: PartialOrd + Display>(
    field: &'static str,
    range: RangeInclusive<T>,
    value: T,
) -> Result<T, OutOfRange> {
    if range.contains(&value) {
        return Ok(value);
    }
    Err(OutOfRange {
        field,
        expected: Cow::Owned(format!("within {}..={}", range.start(), range.end())),
        value: value.to_string(),
    })
}

/// Why a configured endpoint list's addresses were refused.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum EndpointListError {
    #[error("`endpoints` lists {0} endpoints; at most {MAX_ENDPOINTS} are supported")]
    TooMany(usize),
    #[error("`endpoints[{index}].address` {value:?} is not an ip:port address")]
    BadAddress { index: usize, value: String },
    #[error("`endpoints[{index}].address` {value:?} is listed twice")]
    Duplicate { index: usize, value: String },
}

/// Reads a configured endpoint list's addresses, entry by entry: the list at most
/// [`MAX_ENDPOINTS`] long, each address `ip:port` (blanks around it ignored), none twice.
#[derive(Debug, Default)]
pub struct EndpointAddresses {
    seen: HashSet<SocketAddr>,
}

impl EndpointAddresses {
    /// For a list of `len` entries.
    pub fn for_list(len: usize) -> Result<Self, EndpointListError> {
        if len > MAX_ENDPOINTS {
            return Err(EndpointListError::TooMany(len));
        }
        Ok(EndpointAddresses {
            seen: HashSet::with_capacity(len),
        })
    }

    /// Entry `index`'s address, `text`.
    pub fn read(&mut self, index: usize, text: &str) -> Result<SocketAddr, EndpointListError> {
        let value = || text.to_owned();
        let address: SocketAddr =
            text.trim()
                .parse()
                .map_err(|_| EndpointListError::BadAddress {
                    index,
                    value: value(),
                })?;
        if !self.seen.insert(address) {
            return Err(EndpointListError::Duplicate {
                index,
                value: value(),
            });
        }
        Ok(address)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_field_the_range_and_the_value() {
        let e: OutOfRange = out_of_range("tick_ms", "between 1 and 1000", 0);
        assert_eq!(e.to_string(), "`tick_ms` must be between 1 and 1000, got 0");
    }

    #[test]
    fn within_says_the_range_it_checked() {
        assert_eq!(within("ttl_ms", 1_000..=86_400_000, 1_000), Ok(1_000));
        let e = within("ttl_ms", 1_000..=86_400_000, 999).unwrap_err();
        assert_eq!(
            e.to_string(),
            "`ttl_ms` must be within 1000..=86400000, got 999"
        );
        let e = within("kv_high", 0.0..=1.0, f64::NAN).unwrap_err();
        assert_eq!(e.to_string(), "`kv_high` must be within 0..=1, got NaN");
    }

    #[test]
    fn an_endpoint_list_is_short_enough_each_address_ip_port_and_none_twice() {
        assert_eq!(
            EndpointAddresses::for_list(MAX_ENDPOINTS + 1).unwrap_err(),
            EndpointListError::TooMany(MAX_ENDPOINTS + 1)
        );
        let mut list = EndpointAddresses::for_list(3).unwrap();
        assert_eq!(
            list.read(0, " 10.0.0.1:8000 "),
            Ok(SocketAddr::from(([10, 0, 0, 1], 8000)))
        );
        assert_eq!(
            list.read(1, "host:8000"),
            Err(EndpointListError::BadAddress {
                index: 1,
                value: "host:8000".into()
            })
        );
        let twice = list.read(2, "10.0.0.1:8000").unwrap_err();
        assert_eq!(
            twice.to_string(),
            "`endpoints[2].address` \"10.0.0.1:8000\" is listed twice"
        );
    }
}
