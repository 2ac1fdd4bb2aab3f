//! Session stickiness, as the `kvoy_session` filter uses it: where a request's session key
//! comes from ([`KeySource`]), the stateless token ([`encode_token`] / [`decode_token`]), the
//! binding table (session key -> endpoint, with a TTL, in bounded shared data:
//! [`BindingTable`]), and the scanner that finds a Responses API response `id` in a response
//! body as it streams by ([`ResponseIdScanner`]).
//!
//! The session filter never routes: it hands a *candidate* endpoint to the prefix-affinity
//! filter in [`PIN_HEADER`], which only honours it if the endpoint is in its pool (see
//! `Router::route_body`). Tokens and keys from clients can therefore never send traffic outside
//! the pool.
//!
//! ```
//! use kvoy_shared::session::{decode_token, encode_token};
//! let token = encode_token("10.0.0.7:8000".parse().unwrap());
//! assert_eq!(token, "MTAuMC4wLjc6ODAwMA==");
//! assert_eq!(decode_token(&token), Some("10.0.0.7:8000".parse().unwrap()));
//! assert_eq!(decode_token("not base64!"), None);
//! ```

mod config;
mod resolve;
mod scan;
mod table;

pub use config::{KeySource, SessionConfig, SessionConfigError};
pub use resolve::{resolve, RequestKeys, Resolution};
pub use scan::ResponseIdScanner;
pub use table::{BindingTable, BINDINGS_PER_BUCKET};

use std::net::SocketAddr;

pub use crate::protocol::PIN_HEADER;

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// The stateless session token: standard base64 (with padding) of `ip:port`, as the llm-d
/// router writes `x-session-token`.
pub fn encode_token(endpoint: SocketAddr) -> String {
    let text = endpoint.to_string();
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(B64[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn b64_value(c: u8) -> Option<u32> {
    match c {
        b'A'..=b'Z' => Some(u32::from(c - b'A')),
        b'a'..=b'z' => Some(u32::from(c - b'a') + 26),
        b'0'..=b'9' => Some(u32::from(c - b'0') + 52),
        b'+' | b'-' => Some(62),
        b'/' | b'_' => Some(63),
        _ => None,
    }
}

/// Decodes a session token (standard or URL-safe base64, padding optional) into an address;
/// `None` for anything malformed. The caller must still check pool membership.
pub fn decode_token(token: &str) -> Option<SocketAddr> {
    let t = token.trim().trim_end_matches('=');
    if t.is_empty() || t.len() > 96 {
        return None;
    }
    let mut out = Vec::with_capacity(t.len() * 3 / 4);
    let mut acc = 0u32;
    let mut bits = 0;
    for &c in t.as_bytes() {
        acc = (acc << 6) | b64_value(c)?;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push(((acc >> bits) & 0xff) as u8);
        }
    }
    std::str::from_utf8(&out).ok()?.trim().parse().ok()
}

/// The value of cookie `name` in a `cookie` request header, if present.
pub fn cookie_value<'a>(header: &'a str, name: &str) -> Option<&'a str> {
    header.split(';').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k.trim() == name)
            .then(|| v.trim().trim_matches('"'))
            .filter(|v| !v.is_empty())
    })
}

/// The binding-table key of a session key from `source` (sources never collide).
pub fn binding_key(source: KeySource, key: &str) -> String {
    format!("{}:{key}", source.tag())
}

#[cfg(test)]
mod tests;
