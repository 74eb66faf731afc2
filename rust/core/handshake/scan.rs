//! A bounded pre-scan of untrusted msgpack bytes, run before any deserializer allocates.
//!
//! `rmp-serde` hands the claimed length of an array to serde as a size hint, and serde preallocates from
//! it (capped, but per container and per nesting level). The scan walks the bytes once, iteratively, with
//! no allocation beyond a stack bounded by [`MAX_DEPTH`], and rejects any container or string whose claimed
//! length exceeds the limits **or the bytes that are left** (every element takes at least one byte). After
//! it passes, every length the deserializer sees is bounded by the payload size.

use super::error::HandshakeError;

/// Largest payload accepted (bytes); NIXL agent blobs are kilobytes, region lists a few hundred entries.
pub const MAX_PAYLOAD: usize = 8 << 20;
/// Most elements in one array or entries in one map.
pub const MAX_LEN: u64 = 1 << 16;
/// Longest string (bytes); names and ids are short.
pub const MAX_STR: u64 = 4096;
/// Deepest container nesting.
pub const MAX_DEPTH: usize = 16;

/// The bounds a pre-scan enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScanLimits {
    /// Largest input (bytes).
    pub max_bytes: usize,
    /// Most elements in one array or entries in one map.
    pub max_len: u64,
    /// Longest string (bytes; binary values are bounded only by the input).
    pub max_str: u64,
    /// Deepest container nesting.
    pub max_depth: usize,
}

/// The limits of handshake metadata ([`prescan`]).
pub const HANDSHAKE_LIMITS: ScanLimits = ScanLimits {
    max_bytes: MAX_PAYLOAD,
    max_len: MAX_LEN,
    max_str: MAX_STR,
    max_depth: MAX_DEPTH,
};

fn malformed(msg: String) -> HandshakeError {
    HandshakeError::Malformed(msg)
}

/// Big-endian length of `n` bytes at `pos`.
fn read_len(buf: &[u8], pos: usize, n: usize) -> Result<u64, HandshakeError> {
    let bytes = buf
        .get(pos..pos + n)
        .ok_or_else(|| malformed(format!("truncated at byte {pos}: a {n}-byte length needs more bytes")))?;
    Ok(bytes.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
}

/// What one value header says: header bytes, inline payload bytes, child values, and the kind.
struct Head {
    header: usize,
    payload: u64,
    children: u64,
    kind: &'static str,
}

fn head(buf: &[u8], pos: usize) -> Result<Head, HandshakeError> {
    let m = buf[pos];
    let h = |header: usize, payload: u64, children: u64, kind| Head {
        header,
        payload,
        children,
        kind,
    };
    Ok(match m {
        0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => h(1, 0, 0, "scalar"),
        0x80..=0x8f => h(1, 0, 2 * u64::from(m & 0x0f), "map"),
        0x90..=0x9f => h(1, 0, u64::from(m & 0x0f), "array"),
        0xa0..=0xbf => h(1, u64::from(m & 0x1f), 0, "string"),
        0xc4 => h(2, read_len(buf, pos + 1, 1)?, 0, "binary"),
        0xc5 => h(3, read_len(buf, pos + 1, 2)?, 0, "binary"),
        0xc6 => h(5, read_len(buf, pos + 1, 4)?, 0, "binary"),
        0xca => h(1, 4, 0, "scalar"),
        0xcb => h(1, 8, 0, "scalar"),
        0xcc | 0xd0 => h(1, 1, 0, "scalar"),
        0xcd | 0xd1 => h(1, 2, 0, "scalar"),
        0xce | 0xd2 => h(1, 4, 0, "scalar"),
        0xcf | 0xd3 => h(1, 8, 0, "scalar"),
        0xd9 => h(2, read_len(buf, pos + 1, 1)?, 0, "string"),
        0xda => h(3, read_len(buf, pos + 1, 2)?, 0, "string"),
        0xdb => h(5, read_len(buf, pos + 1, 4)?, 0, "string"),
        0xdc => h(3, 0, read_len(buf, pos + 1, 2)?, "array"),
        0xdd => h(5, 0, read_len(buf, pos + 1, 4)?, "array"),
        0xde => h(3, 0, 2 * read_len(buf, pos + 1, 2)?, "map"),
        0xdf => h(5, 0, 2 * read_len(buf, pos + 1, 4)?, "map"),
        0xc1 => return Err(malformed(format!("byte {pos}: 0xc1 is not a msgpack marker"))),
        // 0xc7..=0xc9, 0xd4..=0xd8: extension types, which the metadata never uses.
        _ => {
            return Err(malformed(format!(
                "byte {pos}: msgpack extension type {m:#04x} is not accepted"
            )))
        }
    })
}

/// Check that `buf` holds exactly one msgpack value within the handshake limits ([`HANDSHAKE_LIMITS`]).
///
/// # Errors
/// As [`prescan_within`].
pub fn prescan(buf: &[u8]) -> Result<(), HandshakeError> {
    prescan_within(buf, &HANDSHAKE_LIMITS)
}

/// Check that `buf` holds exactly one msgpack value within `limits`.
///
/// # Errors
/// [`HandshakeError::TooLarge`] for an oversized payload; [`HandshakeError::Malformed`] naming the byte
/// offset for truncation, trailing bytes, unknown markers, extension types, excessive nesting, or a length
/// over a limit or over the bytes left.
pub fn prescan_within(buf: &[u8], limits: &ScanLimits) -> Result<(), HandshakeError> {
    let ScanLimits {
        max_bytes,
        max_len,
        max_str,
        max_depth,
    } = *limits;
    if buf.len() > max_bytes {
        return Err(HandshakeError::TooLarge {
            size: buf.len(),
            max: max_bytes,
        });
    }
    if buf.is_empty() {
        return Err(malformed("empty payload".into()));
    }
    // Values still to read at each open nesting level.
    let mut stack: Vec<u64> = Vec::with_capacity(max_depth.min(64) + 1);
    stack.push(1);
    let mut pos = 0usize;
    while let Some(top) = stack.last_mut() {
        if *top == 0 {
            stack.pop();
            continue;
        }
        *top -= 1;
        if pos >= buf.len() {
            return Err(malformed(format!("truncated at byte {pos}: a value is missing")));
        }
        let head = head(buf, pos)?;
        let left = (buf.len() - pos - head.header) as u64; // read_len proved the header is present
        if head.kind == "string" && head.payload > max_str {
            return Err(malformed(format!(
                "byte {pos}: string of {} bytes exceeds {max_str}",
                head.payload
            )));
        }
        if head.payload > left {
            return Err(malformed(format!(
                "byte {pos}: {} claims {} bytes but only {left} remain",
                head.kind, head.payload
            )));
        }
        if head.children > 0 {
            let entries = if head.kind == "map" {
                head.children / 2
            } else {
                head.children
            };
            if entries > max_len {
                return Err(malformed(format!(
                    "byte {pos}: {} of {entries} entries exceeds {max_len}",
                    head.kind
                )));
            }
            if head.children > left {
                return Err(malformed(format!(
                    "byte {pos}: {} claims {entries} entries but only {left} bytes remain",
                    head.kind
                )));
            }
            if stack.len() > max_depth {
                return Err(malformed(format!("byte {pos}: nesting deeper than {max_depth}")));
            }
            stack.push(head.children);
        }
        pos += head.header + head.payload as usize; // payload <= left, so this stays within buf
    }
    if pos != buf.len() {
        return Err(malformed(format!(
            "{} trailing bytes after the value ending at byte {pos}",
            buf.len() - pos
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_one_value_and_rejects_the_rest() {
        assert!(prescan(&[0x91, 0x01]).is_ok());
        assert!(prescan(&[0x82, 0xa1, b'a', 0x01, 0xa1, b'b', 0xc0]).is_ok());
        let err = |b: &[u8]| prescan(b).unwrap_err().to_string();
        assert!(err(&[]).contains("empty"));
        assert!(
            err(&[0x92, 0x01]).contains("only 1 bytes remain"),
            "{}",
            err(&[0x92, 0x01])
        );
        assert!(err(&[0x01, 0x02]).contains("trailing"));
        assert!(err(&[0xdd, 0xff, 0xff, 0xff, 0xff]).contains("exceeds"));
        assert!(err(&[0xdd, 0x00, 0x00, 0x10, 0x00]).contains("only 0 bytes remain"));
        assert!(err(&[0xc6, 0xff, 0xff, 0xff]).contains("truncated"));
        assert!(err(&[0xc6, 0x7f, 0xff, 0xff, 0xff]).contains("remain"));
        assert!(err(&[0xd4, 0x01, 0x01]).contains("extension"));
        assert!(err(&[0xc1]).contains("0xc1"));
        let deep = vec![0x91u8; 100];
        assert!(err(&deep).contains("nesting"));
        let mut long = vec![0xdbu8, 0, 0, 0x20, 0];
        long.extend(std::iter::repeat_n(b'a', 0x2000));
        assert!(err(&long).contains("string of 8192 bytes"));
        let big = vec![0u8; MAX_PAYLOAD + 1];
        assert!(matches!(prescan(&big), Err(HandshakeError::TooLarge { .. })));
    }

    #[test]
    fn limits_are_the_callers() {
        let tight = ScanLimits {
            max_bytes: 64,
            max_len: 2,
            max_str: 3,
            max_depth: 2,
        };
        let err = |b: &[u8]| prescan_within(b, &tight).unwrap_err().to_string();
        assert!(prescan_within(&[0x92, 0x91, 0x01, 0xa3, b'a', b'b', b'c'], &tight).is_ok());
        assert!(err(&[0x93, 0x01, 0x01, 0x01]).contains("3 entries exceeds 2"));
        assert!(err(&[0xa4, b'a', b'b', b'c', b'd']).contains("string of 4 bytes exceeds 3"));
        assert!(err(&[0x91, 0x91, 0x91, 0x01]).contains("nesting deeper than 2"));
        assert!(matches!(
            prescan_within(&[0u8; 65], &tight),
            Err(HandshakeError::TooLarge { size: 65, max: 64 })
        ));
        // a map nested a thousand deep under one key, as a hostile control message carries it: refused, no recursion
        let mut deep = vec![0x81u8, 0xa1, b'k'];
        for _ in 0..1000 {
            deep.extend([0x81, 0xa1, b'k']);
        }
        deep.push(0xc0);
        assert!(prescan_within(&deep, &HANDSHAKE_LIMITS)
            .unwrap_err()
            .to_string()
            .contains("nesting deeper than 16"));
    }
}
