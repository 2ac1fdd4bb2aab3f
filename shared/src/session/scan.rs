//! Finding a Responses API response `id` in a response body as it streams by, without
//! buffering it: the JSON object (`{"id":"resp_...","object":"response",...}`) and the SSE
//! stream (`event: response.created` / `data: {..."response":{"id":"resp_..."...}}`) both carry
//! it early. The first `"id"` whose string value starts with `resp` is taken (output items'
//! `msg_...` ids are skipped). Only the first [`ResponseIdScanner::LIMIT`] bytes are looked at.

/// Feed response body chunks in order; [`ResponseIdScanner::found`] then has the id.
#[derive(Clone, Debug, Default)]
pub struct ResponseIdScanner {
    carry: Vec<u8>,
    seen: usize,
    found: Option<String>,
}

/// The longest id kept; longer values are not ids we bind.
const MAX_ID: usize = 256;
/// Whitespace bytes allowed on each side of the `:`; with more, the value is not read as an id
/// (servers write none or one space). This bounds a whole match (`"id"`, both runs, `:`, the
/// quoted value) to [`CARRY`] bytes, so that the answer never depends on the chunking.
const MAX_WS: usize = 4;
/// Bytes kept from one chunk to the next, so a match split across chunks is found.
const CARRY: usize = MAX_ID + 16;
/// The longest match: `"id"`, whitespace, `:`, whitespace, then the quoted value.
const MAX_MATCH: usize = 4 + MAX_WS + 1 + MAX_WS + 1 + MAX_ID + 1;
const _: () = assert!(MAX_MATCH <= CARRY);

impl ResponseIdScanner {
    /// Bytes scanned at most.
    pub const LIMIT: usize = 64 * 1024;

    pub fn new() -> Self {
        Self::default()
    }

    /// The response id, once seen.
    pub fn found(&self) -> Option<&str> {
        self.found.as_deref()
    }

    /// Whether feeding more is pointless (found, or past the limit).
    pub fn done(&self) -> bool {
        self.found.is_some() || self.seen >= Self::LIMIT
    }

    /// Scans the next chunk of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        if self.done() {
            return;
        }
        let take = chunk.len().min(Self::LIMIT - self.seen);
        self.seen += take;
        self.carry.extend_from_slice(&chunk[..take]);
        let (found, consumed) = scan(&self.carry);
        if let Some(id) = found {
            self.found = Some(id);
            self.carry = Vec::new();
            return;
        }
        // Keep only what an unfinished match may still need.
        let keep_from = consumed.max(self.carry.len().saturating_sub(CARRY));
        self.carry.drain(..keep_from);
    }
}

/// Searches `buf` for `"id"\s{0,4}:\s{0,4}"resp...`; returns the id and how many leading bytes
/// can no longer start a match.
fn scan(buf: &[u8]) -> (Option<String>, usize) {
    let mut from = 0;
    while let Some(pos) = find(&buf[from..], b"\"id\"") {
        let start = from + pos;
        let mut i = skip_ws(buf, start + 4);
        match buf.get(i) {
            None => return (None, start),
            Some(b':') => i += 1,
            Some(_) => {
                from = start + 1;
                continue;
            }
        }
        i = skip_ws(buf, i);
        match buf.get(i) {
            None => return (None, start),
            Some(b'"') => i += 1,
            Some(_) => {
                from = start + 1;
                continue;
            }
        }
        let value_start = i;
        loop {
            match buf.get(i) {
                None if i - value_start <= MAX_ID => return (None, start),
                None => break,
                Some(b'"') => {
                    let value = &buf[value_start..i];
                    if value.starts_with(b"resp") && value.len() <= MAX_ID {
                        if let Ok(s) = std::str::from_utf8(value) {
                            return (Some(s.to_owned()), i);
                        }
                    }
                    break;
                }
                Some(b'\\') => break,
                Some(_) => i += 1,
            }
        }
        from = start + 1;
    }
    // No complete match: the last few bytes may start one.
    (None, buf.len().saturating_sub(3))
}

/// Past at most [`MAX_WS`] ASCII whitespace bytes from `i`.
fn skip_ws(buf: &[u8], mut i: usize) -> usize {
    let end = i + MAX_WS;
    while i < end && buf.get(i).is_some_and(|b| b.is_ascii_whitespace()) {
        i += 1;
    }
    i
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}
