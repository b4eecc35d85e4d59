//! The end of a gRPC-Web response body: where its trailer frame starts, so
//! that [`StatusBody`](super::StatusBody) can replace the status it carries.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};

use crate::reject::{base64, grpc_web_trailer_frame, unbase64_group};

/// The flag bit of a gRPC-Web frame that carries trailers.
const TRAILERS: u8 = 0x80;

/// Where the scan of the decoded body stands: in a frame's 5-byte prefix
/// (`read` bytes of it, the length so far), or in its payload.
#[derive(Debug)]
enum Scan {
    Prefix { read: u8, len: u32 },
    Payload { left: u32 },
}

impl Scan {
    /// Follows `bytes`; the offset at which a trailer frame starts, if one does.
    fn feed(&mut self, bytes: &[u8]) -> Option<usize> {
        let mut at = 0;
        while at < bytes.len() {
            match self {
                Scan::Prefix { read, len } => {
                    if *read == 0 && bytes[at] & TRAILERS != 0 {
                        return Some(at);
                    }
                    if *read > 0 {
                        *len = *len << 8 | u32::from(bytes[at]);
                    }
                    *read += 1;
                    at += 1;
                    if *read == 5 {
                        *self = if *len == 0 {
                            Scan::Prefix { read: 0, len: 0 }
                        } else {
                            Scan::Payload { left: *len }
                        };
                    }
                }
                Scan::Payload { left } => {
                    let n = (*left).min(u32::try_from(bytes.len() - at).unwrap_or(u32::MAX));
                    *left -= n;
                    at += n as usize;
                    if *left == 0 {
                        *self = Scan::Prefix { read: 0, len: 0 };
                    }
                }
            }
        }
        None
    }
}

/// A gRPC-Web response body followed to its trailer frame. Everything
/// before the trailer frame passes on at once (for `-text`, in whole base64
/// groups); the trailer frame and what follows it are held until the end.
#[derive(Debug)]
pub(super) struct WebEnd {
    text: bool,
    scan: Scan,
    /// `-text`: the characters of an incomplete base64 group, not sent yet.
    pending: Vec<u8>,
    /// From the trailer frame on, the body as sent (for `-text`, from the
    /// base64 group the trailer frame starts in).
    held: Option<Vec<u8>>,
    /// `-text`: how many bytes of the first held group end a message.
    lead: usize,
    /// The body is not gRPC-Web as expected (bad base64): it passes as sent.
    lost: bool,
    /// HTTP trailers of the inner body, to send after the held data.
    pub(super) deferred: Option<HeaderMap>,
}

impl WebEnd {
    pub(super) fn new(text: bool) -> Self {
        WebEnd {
            text,
            scan: Scan::Prefix { read: 0, len: 0 },
            pending: Vec::new(),
            held: None,
            lead: 0,
            lost: false,
            deferred: None,
        }
    }

    /// Whether nothing is held back.
    pub(super) fn is_empty(&self) -> bool {
        self.pending.is_empty() && self.held.is_none() && self.deferred.is_none()
    }

    /// The part of `data` to send now.
    pub(super) fn data(&mut self, data: Bytes) -> Bytes {
        if self.lost {
            return data;
        }
        if let Some(held) = &mut self.held {
            held.extend_from_slice(&data);
            return Bytes::new();
        }
        if !self.text {
            return match self.scan.feed(&data) {
                Some(at) => {
                    self.held = Some(data[at..].to_vec());
                    data.slice(..at)
                }
                None => data,
            };
        }
        let combined = if self.pending.is_empty() {
            data
        } else {
            let mut combined = std::mem::take(&mut self.pending);
            combined.extend_from_slice(&data);
            Bytes::from(combined)
        };
        let whole = combined.len() / 4 * 4;
        for start in (0..whole).step_by(4) {
            let group = [
                combined[start],
                combined[start + 1],
                combined[start + 2],
                combined[start + 3],
            ];
            let Some((bytes, n)) = unbase64_group(group) else {
                self.lost = true;
                return combined;
            };
            if let Some(k) = self.scan.feed(&bytes[..n]) {
                // A group that also ends a message is held whole, so that
                // an unrefused body passes byte for byte.
                self.lead = k;
                self.held = Some(combined[start..].to_vec());
                return combined.slice(..start);
            }
        }
        self.pending = combined[whole..].to_vec();
        combined.slice(..whole)
    }

    /// The rest of the body once the inner one ended, with `http_trailers`
    /// if it sent any: as sent, or, when `refuse` gives the trailers that
    /// replace them, one trailer frame that carries those.
    pub(super) fn finish(
        &mut self,
        http_trailers: Option<HeaderMap>,
        refuse: Option<impl FnOnce(HeaderMap) -> HeaderMap>,
    ) -> (Bytes, Option<HeaderMap>) {
        let mut out = std::mem::take(&mut self.pending);
        let held = self.held.take();
        match refuse {
            Some(refuse) => {
                let decoded = held.as_deref().map(|held| self.decode(held));
                let (tail, frame) = decoded
                    .as_deref()
                    .unwrap_or_default()
                    .split_at(self.lead.min(decoded.as_ref().map_or(0, Vec::len)));
                if !tail.is_empty() {
                    // The end of the last message, in a base64 group of its own.
                    out.extend(base64(tail));
                }
                let mut trailers = parse_trailers(frame);
                if let Some(http) = http_trailers {
                    trailers.extend(http);
                }
                out.extend_from_slice(&grpc_web_trailer_frame(&refuse(trailers), self.text));
                (Bytes::from(out), None)
            }
            None => {
                out.extend(held.unwrap_or_default());
                (Bytes::from(out), http_trailers)
            }
        }
    }

    /// The held bytes decoded: for `-text`, every whole base64 group up to
    /// the first that is not base64.
    fn decode(&self, held: &[u8]) -> Vec<u8> {
        if !self.text {
            return held.to_vec();
        }
        let mut bytes = Vec::with_capacity(held.len() / 4 * 3);
        for group in held.chunks_exact(4) {
            match unbase64_group([group[0], group[1], group[2], group[3]]) {
                Some((b, n)) => bytes.extend_from_slice(&b[..n]),
                None => break,
            }
        }
        bytes
    }
}

/// The trailers of a trailer frame (`name:value` lines); lines that are no
/// header are left out.
fn parse_trailers(frame: &[u8]) -> HeaderMap {
    let mut trailers = HeaderMap::new();
    let Some(block) = frame.get(5..) else {
        return trailers;
    };
    let len = u32::from_be_bytes([frame[1], frame[2], frame[3], frame[4]]) as usize;
    let block = &block[..len.min(block.len())];
    for line in block.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let name = HeaderName::from_bytes(line[..colon].trim_ascii());
        let value = HeaderValue::from_bytes(line[colon + 1..].trim_ascii());
        if let (Ok(name), Ok(value)) = (name, value) {
            trailers.append(name, value);
        }
    }
    trailers
}
