//! The bytes on the runtime's socket: NRI's multiplexer and ttRPC's message framing.
//!
//! One unix connection carries frames `[connection id: u32 BE][payload length: u32 BE][payload]`.
//! Each multiplexed connection is a byte stream of its own, holding ttRPC messages
//! `[length: u32 BE][stream id: u32 BE][type: u8][flags: u8][payload]`; a message may span
//! frames, and a frame may hold parts of several messages. This module turns incoming frames
//! into whole, size-checked messages ([`Reassembler`]) and messages into frames
//! ([`encode_frames`]); everything malformed is a [`WireError`].

/// The mux connection the runtime calls the plugin on (the plugin serves NRI's `Plugin`).
pub const PLUGIN_CONN: u32 = 1;
/// The mux connection the plugin calls the runtime on (the runtime serves NRI's `Runtime`).
pub const RUNTIME_CONN: u32 = 2;

pub const FRAME_HEADER_LEN: usize = 8;
/// The largest frame payload accepted (NRI 0.6's own limit; later versions send at most
/// 4 MiB + 10).
pub const MAX_FRAME_PAYLOAD: usize = 1 << 24;
pub const MESSAGE_HEADER_LEN: usize = 10;
/// The largest ttRPC message payload accepted (ttRPC's own is 4 MiB; a large node's
/// Synchronize from an older runtime may be bigger).
pub const MAX_MESSAGE_PAYLOAD: usize = 1 << 24;
/// The largest ttRPC message payload the plugin sends: what ttRPC's Go side accepts.
pub const MAX_OUTGOING_PAYLOAD: usize = 4 << 20;
/// The first frame of an outgoing message holds at most this many bytes of it, then the rest
/// follows in one frame (as Go's ttRPC writes through its 4 KiB buffer, so a Go reader gets
/// frames no larger than the reads it makes).
const FIRST_FRAME_MAX: usize = 4096;

/// ttRPC message types.
pub const TYPE_REQUEST: u8 = 1;
pub const TYPE_RESPONSE: u8 = 2;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    #[error("a mux frame names connection 0, which is reserved")]
    ReservedConnection,
    #[error("a mux frame of {0} bytes, over the limit of {max}", max = MAX_FRAME_PAYLOAD)]
    FrameTooLarge(u32),
    #[error("a ttRPC message of {0} bytes, over the limit of {max}", max = MAX_MESSAGE_PAYLOAD)]
    MessageTooLarge(u32),
}

/// A mux frame's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub conn: u32,
    pub len: u32,
}

impl FrameHeader {
    /// Reads and checks a frame header: connection 0 and oversized payloads are refused.
    pub fn decode(bytes: [u8; FRAME_HEADER_LEN]) -> Result<Self, WireError> {
        let conn = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        let len = u32::from_be_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
        if conn == 0 {
            return Err(WireError::ReservedConnection);
        }
        if len as usize > MAX_FRAME_PAYLOAD {
            return Err(WireError::FrameTooLarge(len));
        }
        Ok(Self { conn, len })
    }

    pub fn encode(self) -> [u8; FRAME_HEADER_LEN] {
        let mut out = [0; FRAME_HEADER_LEN];
        out[..4].copy_from_slice(&self.conn.to_be_bytes());
        out[4..].copy_from_slice(&self.len.to_be_bytes());
        out
    }
}

/// A ttRPC message's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageHeader {
    pub len: u32,
    pub stream: u32,
    pub kind: u8,
    pub flags: u8,
}

/// A whole ttRPC message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub stream: u32,
    pub kind: u8,
    pub flags: u8,
    pub payload: Vec<u8>,
}

/// A ttRPC message's bytes: header, then payload. The payload's size is the caller's to keep
/// within [`MAX_OUTGOING_PAYLOAD`].
pub fn encode_message(stream: u32, kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
    let mut out = Vec::with_capacity(MESSAGE_HEADER_LEN + payload.len());
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(&stream.to_be_bytes());
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(payload);
    out
}

/// Frames `bytes` (one or more messages) for mux connection `conn`: the first frame holds up
/// to 4 KiB, the rest follows in frames of at most [`MAX_FRAME_PAYLOAD`].
pub fn encode_frames(conn: u32, bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len() + 2 * FRAME_HEADER_LEN);
    let first = bytes.len().min(FIRST_FRAME_MAX);
    let chunks = std::iter::once(&bytes[..first]).chain(bytes[first..].chunks(MAX_FRAME_PAYLOAD));
    for chunk in chunks {
        // Each chunk is at most MAX_FRAME_PAYLOAD (2^24) long: it fits a u32.
        let len = chunk.len() as u32;
        out.extend_from_slice(&FrameHeader { conn, len }.encode());
        out.extend_from_slice(chunk);
    }
    out
}

/// One mux connection's incoming byte stream, cut into ttRPC messages.
#[derive(Debug, Default)]
pub struct Reassembler {
    buf: Vec<u8>,
}

impl Reassembler {
    /// Appends a frame's payload.
    pub fn push(&mut self, payload: &[u8]) {
        self.buf.extend_from_slice(payload);
    }

    /// The next whole message, if one has arrived; an oversized one is refused as soon as its
    /// header is seen.
    pub fn next_message(&mut self) -> Result<Option<Message>, WireError> {
        let Some(header) = self.buf.get(..MESSAGE_HEADER_LEN) else {
            return Ok(None);
        };
        let header = MessageHeader {
            len: u32::from_be_bytes([header[0], header[1], header[2], header[3]]),
            stream: u32::from_be_bytes([header[4], header[5], header[6], header[7]]),
            kind: header[8],
            flags: header[9],
        };
        let len = header.len as usize;
        if len > MAX_MESSAGE_PAYLOAD {
            return Err(WireError::MessageTooLarge(header.len));
        }
        if self.buf.len() < MESSAGE_HEADER_LEN + len {
            return Ok(None);
        }
        let payload = self.buf[MESSAGE_HEADER_LEN..MESSAGE_HEADER_LEN + len].to_vec();
        self.buf.drain(..MESSAGE_HEADER_LEN + len);
        Ok(Some(Message {
            stream: header.stream,
            kind: header.kind,
            flags: header.flags,
            payload,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_header_bytes_are_big_endian_conn_then_length() {
        let bytes = FrameHeader {
            conn: 0x0102_0304,
            len: 0x00ab_cdef,
        }
        .encode();
        assert_eq!(bytes, [1, 2, 3, 4, 0, 0xab, 0xcd, 0xef]);
        assert_eq!(
            FrameHeader::decode(bytes),
            Ok(FrameHeader {
                conn: 0x0102_0304,
                len: 0x00ab_cdef
            })
        );
    }

    #[test]
    fn frame_header_refuses_connection_zero_and_oversized_payloads() {
        assert_eq!(
            FrameHeader::decode([0, 0, 0, 0, 0, 0, 0, 1]),
            Err(WireError::ReservedConnection)
        );
        // 16 MiB is accepted, one byte more is not.
        assert!(FrameHeader::decode([0, 0, 0, 1, 0x01, 0, 0, 0]).is_ok());
        assert_eq!(
            FrameHeader::decode([0, 0, 0, 1, 0x01, 0, 0, 1]),
            Err(WireError::FrameTooLarge(0x0100_0001))
        );
    }

    #[test]
    fn message_bytes_are_length_stream_type_flags_payload() {
        let bytes = encode_message(0x0a0b_0c0d, TYPE_RESPONSE, 4, b"xyz");
        assert_eq!(
            bytes,
            [0, 0, 0, 3, 0x0a, 0x0b, 0x0c, 0x0d, 2, 4, b'x', b'y', b'z']
        );
    }

    #[test]
    fn a_small_message_is_one_frame() {
        let message = encode_message(1, TYPE_REQUEST, 0, &[7]);
        let frames = encode_frames(PLUGIN_CONN, &message);
        assert_eq!(
            frames,
            [
                &[0, 0, 0, 1, 0, 0, 0, 11][..],
                &[0, 0, 0, 1, 0, 0, 0, 1, 1, 0, 7]
            ]
            .concat()
        );
    }

    #[test]
    fn a_large_message_is_a_4k_frame_then_one_frame_with_the_rest() {
        let message = vec![0x5a; 10_000];
        let frames = encode_frames(RUNTIME_CONN, &message);
        assert_eq!(&frames[..8], &[0, 0, 0, 2, 0, 0, 0x10, 0]);
        let second = 8 + 4096;
        // 10000 - 4096 = 5904 = 0x1710.
        assert_eq!(&frames[second..second + 8], &[0, 0, 0, 2, 0, 0, 0x17, 0x10]);
        assert_eq!(frames.len(), 10_000 + 16);
    }

    #[test]
    fn messages_are_cut_from_a_stream_split_anywhere() {
        let mut stream = encode_message(1, TYPE_REQUEST, 0, b"first");
        stream.extend(encode_message(3, TYPE_REQUEST, 0, b""));
        stream.extend(encode_message(5, 3, 1, &[9; 300]));
        for cut in [1, 3, 10, 14, 17, 50] {
            let mut reassembler = Reassembler::default();
            let mut got = Vec::new();
            for piece in stream.chunks(cut) {
                reassembler.push(piece);
                while let Some(message) = reassembler.next_message().expect("well-formed") {
                    got.push(message);
                }
            }
            assert_eq!(got.len(), 3, "cut every {cut} bytes");
            assert_eq!(
                got[0],
                Message {
                    stream: 1,
                    kind: TYPE_REQUEST,
                    flags: 0,
                    payload: b"first".to_vec()
                }
            );
            assert_eq!(
                got[1],
                Message {
                    stream: 3,
                    kind: TYPE_REQUEST,
                    flags: 0,
                    payload: vec![]
                }
            );
            assert_eq!(
                got[2],
                Message {
                    stream: 5,
                    kind: 3,
                    flags: 1,
                    payload: vec![9; 300]
                }
            );
        }
    }

    #[test]
    fn an_oversized_message_is_refused_from_its_header() {
        let mut reassembler = Reassembler::default();
        reassembler.push(&[0x01, 0, 0, 1, 0, 0, 0, 1, 1, 0]);
        assert_eq!(
            reassembler.next_message(),
            Err(WireError::MessageTooLarge(0x0100_0001))
        );
        // Exactly the limit waits for its payload.
        let mut reassembler = Reassembler::default();
        reassembler.push(&[0x01, 0, 0, 0, 0, 0, 0, 1, 1, 0]);
        assert_eq!(reassembler.next_message(), Ok(None));
    }
}
