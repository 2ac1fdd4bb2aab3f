//! A tiny HTTP/1.1 codec and client over `std::net`, shared by the echo backend and the tests.
//!
//! Everything read from the network is bounded: the request/status line and headers by
//! [`MAX_HEAD_BYTES`], bodies by a caller-given limit, chunk sizes by the same limit.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use thiserror::Error;

/// Largest request/status line plus headers accepted.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Most header lines accepted in one message.
pub const MAX_HEADERS: usize = 128;

/// A failure to read or write an HTTP/1.1 message.
#[derive(Debug, Error)]
pub enum HttpError {
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error("malformed message: {0}")]
    Malformed(&'static str),
    #[error("{what} exceeds the limit of {limit} bytes")]
    TooLarge { what: &'static str, limit: usize },
    #[error("connection closed in the middle of a message")]
    UnexpectedEof,
}

/// Header lines in arrival order; names keep their case, lookups ignore it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Headers(pub Vec<(String, String)>);

impl Headers {
    /// The first value of `name` (case-insensitive).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn is_chunked(&self) -> bool {
        self.get("transfer-encoding")
            .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"))
    }

    fn content_length(&self) -> Result<Option<usize>, HttpError> {
        match self.get("content-length") {
            None => Ok(None),
            Some(v) => v
                .trim()
                .parse::<usize>()
                .map(Some)
                .map_err(|_| HttpError::Malformed("content-length is not a number")),
        }
    }
}

/// The first line and the headers of a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Head {
    pub start_line: String,
    pub headers: Headers,
}

/// Reads one CRLF- (or LF-) terminated line into `buf` without the terminator, spending at most
/// `*budget` bytes. Returns false on EOF before any byte.
fn read_line<R: BufRead>(
    r: &mut R,
    buf: &mut Vec<u8>,
    budget: &mut usize,
) -> Result<bool, HttpError> {
    buf.clear();
    let limit = u64::try_from(*budget).unwrap_or(u64::MAX).saturating_add(1);
    let n = r.by_ref().take(limit).read_until(b'\n', buf)?;
    if n == 0 {
        return Ok(false);
    }
    if n > *budget {
        return Err(HttpError::TooLarge {
            what: "message head",
            limit: MAX_HEAD_BYTES,
        });
    }
    *budget -= n;
    if buf.last() != Some(&b'\n') {
        return Err(HttpError::UnexpectedEof);
    }
    buf.pop();
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    Ok(true)
}

/// Reads a message head. `Ok(None)` means the peer closed cleanly before sending anything.
pub fn read_head<R: BufRead>(r: &mut R) -> Result<Option<Head>, HttpError> {
    let mut budget = MAX_HEAD_BYTES;
    let mut line = Vec::with_capacity(256);
    if !read_line(r, &mut line, &mut budget)? {
        return Ok(None);
    }
    let start_line = String::from_utf8(line.clone())
        .map_err(|_| HttpError::Malformed("start line is not UTF-8"))?;
    let mut headers = Vec::new();
    loop {
        if !read_line(r, &mut line, &mut budget)? {
            return Err(HttpError::UnexpectedEof);
        }
        if line.is_empty() {
            break;
        }
        if headers.len() == MAX_HEADERS {
            return Err(HttpError::TooLarge {
                what: "header count",
                limit: MAX_HEADERS,
            });
        }
        let text =
            std::str::from_utf8(&line).map_err(|_| HttpError::Malformed("header is not UTF-8"))?;
        let (name, value) = text
            .split_once(':')
            .ok_or(HttpError::Malformed("header line without a colon"))?;
        if name.is_empty() || name.contains(char::is_whitespace) {
            return Err(HttpError::Malformed("invalid header name"));
        }
        headers.push((name.to_string(), value.trim().to_string()));
    }
    Ok(Some(Head {
        start_line,
        headers: Headers(headers),
    }))
}

/// How to find the end of a body that has neither a length nor chunked framing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unframed {
    /// A request: no body.
    Empty,
    /// A response: the body runs until the peer closes.
    UntilClose,
}

/// Reads the body that follows `headers`, at most `max` bytes.
pub fn read_body<R: BufRead>(
    r: &mut R,
    headers: &Headers,
    max: usize,
    unframed: Unframed,
) -> Result<Vec<u8>, HttpError> {
    let too_large = HttpError::TooLarge {
        what: "body",
        limit: max,
    };
    if headers.is_chunked() {
        return read_chunked(r, max);
    }
    if let Some(len) = headers.content_length()? {
        if len > max {
            return Err(too_large);
        }
        let mut body = vec![0; len];
        r.read_exact(&mut body).map_err(eof_as_unexpected)?;
        return Ok(body);
    }
    let mut body = Vec::new();
    if unframed == Unframed::UntilClose {
        let limit = u64::try_from(max).unwrap_or(u64::MAX).saturating_add(1);
        r.take(limit).read_to_end(&mut body)?;
        if body.len() > max {
            return Err(too_large);
        }
    }
    Ok(body)
}

fn eof_as_unexpected(e: io::Error) -> HttpError {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        HttpError::UnexpectedEof
    } else {
        HttpError::Io(e)
    }
}

fn read_chunked<R: BufRead>(r: &mut R, max: usize) -> Result<Vec<u8>, HttpError> {
    let mut body = Vec::new();
    let mut line = Vec::with_capacity(32);
    // Each chunk adds at least one byte, so `max + 2` rounds bound the loop (the extra two are the
    // terminating zero chunk and slack).
    for _ in 0..max.saturating_add(2) {
        let mut budget = 1024;
        if !read_line(r, &mut line, &mut budget)? {
            return Err(HttpError::UnexpectedEof);
        }
        let text = std::str::from_utf8(&line)
            .map_err(|_| HttpError::Malformed("chunk size is not UTF-8"))?;
        let size_text = text.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| HttpError::Malformed("chunk size is not hexadecimal"))?;
        if size == 0 {
            // Trailers, then the empty line.
            let mut budget = MAX_HEAD_BYTES;
            for _ in 0..MAX_HEADERS {
                if !read_line(r, &mut line, &mut budget)? || line.is_empty() {
                    return Ok(body);
                }
            }
            return Err(HttpError::TooLarge {
                what: "trailer count",
                limit: MAX_HEADERS,
            });
        }
        if body.len().saturating_add(size) > max {
            return Err(HttpError::TooLarge {
                what: "body",
                limit: max,
            });
        }
        let start = body.len();
        body.resize(start + size, 0);
        r.read_exact(&mut body[start..])
            .map_err(eof_as_unexpected)?;
        let mut crlf = [0u8; 2];
        r.read_exact(&mut crlf).map_err(eof_as_unexpected)?;
        if &crlf != b"\r\n" {
            return Err(HttpError::Malformed("chunk not followed by CRLF"));
        }
    }
    Err(HttpError::Malformed("too many chunks"))
}

/// Writes one chunk of a chunked body (an empty `data` is skipped: it would end the body).
pub fn write_chunk<W: Write>(w: &mut W, data: &[u8]) -> io::Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    write!(w, "{:x}\r\n", data.len())?;
    w.write_all(data)?;
    w.write_all(b"\r\n")
}

/// Ends a chunked body.
pub fn write_last_chunk<W: Write>(w: &mut W) -> io::Result<()> {
    w.write_all(b"0\r\n\r\n")
}

/// A response as the client saw it.
#[derive(Clone, Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Headers,
    pub body: Vec<u8>,
}

impl Response {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name)
    }

    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body parsed as JSON.
    pub fn json(&self) -> Result<serde_json::Value, serde_json::Error> {
        serde_json::from_slice(&self.body)
    }
}

/// Largest response body the client reads.
pub const MAX_CLIENT_BODY: usize = 64 * 1024 * 1024;

/// One request on a fresh connection (`Connection: close`), with a `Content-Length` body when
/// `body` is non-empty or the method is POST/PUT. `timeout` bounds connect and each read/write.
pub fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> Result<Response, HttpError> {
    let stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.set_nodelay(true)?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if !body.is_empty() || method == "POST" || method == "PUT" {
        head.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    let mut writer = &stream;
    writer.write_all(head.as_bytes())?;
    writer.write_all(body)?;
    writer.flush()?;
    let mut reader = BufReader::new(&stream);
    let head = read_head(&mut reader)?.ok_or(HttpError::UnexpectedEof)?;
    let mut parts = head.start_line.splitn(3, ' ');
    let version = parts.next().unwrap_or("");
    if !version.starts_with("HTTP/1.") {
        return Err(HttpError::Malformed("status line is not HTTP/1.x"));
    }
    let status = parts
        .next()
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or(HttpError::Malformed("status code is not a number"))?;
    let body = if method == "HEAD" || status == 204 || status == 304 {
        Vec::new()
    } else {
        read_body(
            &mut reader,
            &head.headers,
            MAX_CLIENT_BODY,
            Unframed::UntilClose,
        )?
    };
    Ok(Response {
        status,
        headers: head.headers,
        body,
    })
}

/// `send` for a POST of a JSON body.
pub fn post_json(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> Result<Response, HttpError> {
    let mut all = Vec::with_capacity(headers.len() + 1);
    all.push(("content-type", "application/json"));
    all.extend_from_slice(headers);
    send(addr, "POST", path, &all, body, timeout)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn parse(raw: &[u8]) -> Result<(Head, Vec<u8>), HttpError> {
        let mut r = BufReader::new(raw);
        let head = read_head(&mut r)?.expect("head");
        let body = read_body(&mut r, &head.headers, 1024, Unframed::Empty)?;
        Ok((head, body))
    }

    #[test]
    fn content_length_body() {
        let (head, body) =
            parse(b"POST /x HTTP/1.1\r\nContent-Length: 5\r\nX-A: b\r\n\r\nhelloEXTRA").unwrap();
        assert_eq!(head.start_line, "POST /x HTTP/1.1");
        assert_eq!(head.headers.get("x-a"), Some("b"));
        assert_eq!(body, b"hello");
    }

    #[test]
    fn chunked_body_with_extension_and_trailer() {
        let raw = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\nA\r\n0123456789\r\n0\r\nT: v\r\n\r\n";
        let (_, body) = parse(raw).unwrap();
        assert_eq!(body, b"abc0123456789");
    }

    #[test]
    fn rejects_bad_input() {
        assert!(matches!(
            parse(b"POST / HTTP/1.1\r\nContent-Length: x\r\n\r\n"),
            Err(HttpError::Malformed(_))
        ));
        assert!(matches!(
            parse(b"POST / HTTP/1.1\r\nContent-Length: 5000\r\n\r\n"),
            Err(HttpError::TooLarge { .. })
        ));
        assert!(matches!(
            parse(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
            Err(HttpError::Malformed(_))
        ));
        assert!(matches!(
            parse(b"POST / HTTP/1.1\r\nContent-Length: 9\r\n\r\nabc"),
            Err(HttpError::UnexpectedEof)
        ));
        assert!(matches!(
            parse(b"POST / HTTP/1.1\r\nno colon\r\n\r\n"),
            Err(HttpError::Malformed(_))
        ));
        let huge = format!(
            "GET / HTTP/1.1\r\nx: {}\r\n\r\n",
            "a".repeat(MAX_HEAD_BYTES)
        );
        assert!(matches!(
            parse(huge.as_bytes()),
            Err(HttpError::TooLarge { .. })
        ));
    }

    #[test]
    fn clean_eof_is_none() {
        let mut r = BufReader::new(&b""[..]);
        assert!(read_head(&mut r).unwrap().is_none());
    }
}
