//! The gRPC-Web trailer frame.

use bytes::Bytes;
use http::HeaderMap;

use super::base64::base64;

/// The gRPC-Web trailer frame that carries `trailers` in a response body:
/// flag byte `0x80`, the 4-byte big-endian length, then each trailer as
/// `name:value\r\n`; base64 when `text`.
pub(crate) fn grpc_web_trailer_frame(trailers: &HeaderMap, text: bool) -> Bytes {
    let mut block = Vec::new();
    for (name, value) in trailers {
        block.extend_from_slice(name.as_str().as_bytes());
        block.push(b':');
        block.extend_from_slice(value.as_bytes());
        block.extend_from_slice(b"\r\n");
    }
    let mut frame = Vec::with_capacity(block.len() + 5);
    frame.push(0x80);
    frame.extend_from_slice(&u32::try_from(block.len()).unwrap_or(u32::MAX).to_be_bytes());
    frame.extend_from_slice(&block);
    if text {
        Bytes::from(base64(&frame))
    } else {
        Bytes::from(frame)
    }
}
