//! Session keys from clients and servers (`kvoy_shared::session`): the stateless token, the
//! cookie header, and the Responses API id scanner over a streamed response body.
//!
//! Beyond "no panic":
//! - a token that decodes re-encodes to a token that decodes to the same address, and every
//!   address (from the input's bytes) survives `encode_token` / `decode_token`;
//! - a cookie value is a non-empty, `;`-free substring of the header;
//! - the id scanner finds the same id however the body is cut into chunks, and what it finds
//!   starts with `resp`, is at most 256 bytes, and is in the first 64 KiB of the body.
#![no_main]

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};

use kvoy_fuzz::{chunking, chunks};
use kvoy_shared::session::{cookie_value, decode_token, encode_token, ResponseIdScanner};
use libfuzzer_sys::fuzz_target;

fn address(b: &[u8]) -> Option<SocketAddr> {
    let (&family, rest) = b.split_first()?;
    if family & 1 == 0 {
        let ip: [u8; 4] = rest.get(..4)?.try_into().ok()?;
        let port = u16::from_be_bytes(rest.get(4..6)?.try_into().ok()?);
        Some(SocketAddr::new(Ipv4Addr::from(ip).into(), port))
    } else {
        let ip: [u8; 16] = rest.get(..16)?.try_into().ok()?;
        let port = u16::from_be_bytes(rest.get(16..18)?.try_into().ok()?);
        Some(SocketAddr::new(Ipv6Addr::from(ip).into(), port))
    }
}

fn scan(chunks: &[&[u8]]) -> Option<String> {
    let mut s = ResponseIdScanner::new();
    for c in chunks {
        s.feed(c);
    }
    s.found().map(str::to_owned)
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);

    // Tokens.
    if let Some(addr) = decode_token(&text) {
        assert_eq!(
            decode_token(&encode_token(addr)),
            Some(addr),
            "token {text:?}"
        );
    }
    if let Some(addr) = address(data) {
        let token = encode_token(addr);
        assert!(token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"+/=".contains(&b)));
        assert_eq!(decode_token(&token), Some(addr));
    }

    // Cookies: the name is what comes before the first NUL.
    if let Some((name, header)) = text.split_once('\0') {
        if let Some(v) = cookie_value(header, name) {
            assert!(!v.is_empty() && !v.contains(';'));
            assert!(header.contains(v));
        }
    }

    // The response id scanner, whole and in chunks.
    let (cuts, body) = chunking(data);
    let whole = scan(&[body]);
    let pieces = scan(&chunks(body, &cuts));
    assert_eq!(whole, pieces, "cut at {cuts:?}");
    if let Some(id) = &whole {
        assert!(id.starts_with("resp") && id.len() <= 256);
        let head = &body[..body.len().min(ResponseIdScanner::LIMIT)];
        assert!(head.windows(id.len()).any(|w| w == id.as_bytes()));
    }
});
