//! From a request's session keys to a pin and the keys to bind, in the configured order.

use std::net::SocketAddr;

use super::{binding_key, decode_token, KeySource, SessionConfig};

/// The session keys a request carries (each `None` when absent).
#[derive(Clone, Copy, Debug, Default)]
pub struct RequestKeys<'a> {
    pub header: Option<&'a str>,
    pub cookie: Option<&'a str>,
    pub token: Option<&'a str>,
    pub previous_response_id: Option<&'a str>,
    pub conversation: Option<&'a str>,
}

/// What to do with a request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resolution {
    /// The endpoint to hand over, and where it came from.
    pub pin: Option<(KeySource, SocketAddr)>,
    /// Binding keys to (re)bind to the serving endpoint on the response.
    pub bind: Vec<String>,
    /// Whether the request carried any key or token.
    pub keyed: bool,
    /// A token was present but malformed (ignored).
    pub invalid_token: bool,
}

/// Resolves `keys` in `config.key_sources` order: the first source that yields an endpoint
/// pins; every stateful key present (header, cookie, conversation) is rebound on the response.
/// `lookup` reads the binding table.
pub fn resolve(
    config: &SessionConfig,
    keys: &RequestKeys<'_>,
    mut lookup: impl FnMut(&str) -> Option<SocketAddr>,
) -> Resolution {
    let mut r = Resolution::default();
    for &source in &config.key_sources {
        let value = match source {
            KeySource::Header => keys.header,
            KeySource::Cookie => keys.cookie.filter(|_| config.cookie.is_some()),
            KeySource::Token => keys.token,
            KeySource::PreviousResponseId => keys.previous_response_id,
            KeySource::Conversation => keys.conversation,
        };
        let Some(value) = value
            .map(str::trim)
            .filter(|v| !v.is_empty() && v.len() <= 1024)
        else {
            continue;
        };
        r.keyed = true;
        match source {
            KeySource::Token => match decode_token(value) {
                Some(addr) => {
                    if r.pin.is_none() {
                        r.pin = Some((source, addr));
                    }
                }
                None => r.invalid_token = true,
            },
            _ => {
                let key = binding_key(source, value);
                if r.pin.is_none() {
                    if let Some(addr) = lookup(&key) {
                        r.pin = Some((source, addr));
                    }
                }
                // A previous response id names a past turn; the new turn's own id is bound
                // when its response arrives.
                if source != KeySource::PreviousResponseId {
                    r.bind.push(key);
                }
            }
        }
    }
    r
}
