//! Standard base64, as gRPC-Web-text writes its bodies.

const BASE64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding, as gRPC-Web-text writes its bodies.
pub(crate) fn base64(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..4 {
            out.push(if i <= chunk.len() {
                BASE64[(n >> (18 - 6 * i) & 63) as usize]
            } else {
                b'='
            });
        }
    }
    out
}

/// The bytes of one group of four base64 characters (one to three; fewer
/// when padded), or `None` when it is not base64.
pub(crate) fn unbase64_group(group: [u8; 4]) -> Option<([u8; 3], usize)> {
    let mut n = 0u32;
    let mut chars = 0;
    for (i, &c) in group.iter().enumerate() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            // Padding only at the end, after at least two characters.
            b'=' if i >= 2 && group[i..].iter().all(|&p| p == b'=') => break,
            _ => return None,
        };
        n |= u32::from(v) << (18 - 6 * i);
        chars += 1;
    }
    let [_, a, b, c] = n.to_be_bytes();
    Some(([a, b, c], chars - 1))
}
