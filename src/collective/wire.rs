//! Frames on a rank's socket: a tag, the collective's sequence number, a flag word and
//! a payload (JSON for the rendezvous, little-endian numbers for the collectives).

use std::io::{self, Read, Write};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tag {
    /// A rank introduces itself to rank 0.
    Hello = 1,
    /// Rank 0 accepts: the run dir and every member.
    Welcome = 2,
    /// Rank 0 refuses the run, with the reason.
    Reject = 3,
    /// A rank's buffer for a collective.
    Contribute = 4,
    /// Rank 0's result of a collective.
    Result = 5,
    /// Rank 0 ends the run, with the reason.
    Abort = 6,
}

impl Tag {
    fn from_u8(b: u8) -> Option<Tag> {
        Some(match b {
            1 => Tag::Hello,
            2 => Tag::Welcome,
            3 => Tag::Reject,
            4 => Tag::Contribute,
            5 => Tag::Result,
            6 => Tag::Abort,
            _ => return None,
        })
    }
}

pub struct Frame {
    pub tag: Tag,
    pub seq: u64,
    pub flags: u32,
    pub payload: Vec<u8>,
}

/// Payloads above this are not a kiln peer's: 16 GiB, above any model's gradients.
const MAX_PAYLOAD: u64 = 16 << 30;

pub fn write_frame(
    w: &mut impl Write,
    tag: Tag,
    seq: u64,
    flags: u32,
    payload: &[u8],
) -> io::Result<()> {
    let mut head = [0u8; 21];
    head[0] = tag as u8;
    head[1..9].copy_from_slice(&seq.to_le_bytes());
    head[9..13].copy_from_slice(&flags.to_le_bytes());
    head[13..21].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    w.write_all(&head)?;
    w.write_all(payload)?;
    w.flush()
}

/// Reads one frame; `payload` is reused as the buffer.
pub fn read_frame(r: &mut impl Read, mut payload: Vec<u8>) -> io::Result<Frame> {
    let mut head = [0u8; 21];
    r.read_exact(&mut head)?;
    let invalid = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_string());
    let tag = Tag::from_u8(head[0]).ok_or_else(|| invalid("not a kiln frame"))?;
    let seq = u64::from_le_bytes(head[1..9].try_into().expect("8 bytes"));
    let flags = u32::from_le_bytes(head[9..13].try_into().expect("4 bytes"));
    let len = u64::from_le_bytes(head[13..21].try_into().expect("8 bytes"));
    if len > MAX_PAYLOAD {
        return Err(invalid("frame larger than any kiln payload"));
    }
    payload.clear();
    payload.resize(len as usize, 0);
    r.read_exact(&mut payload)?;
    Ok(Frame {
        tag,
        seq,
        flags,
        payload,
    })
}

/// A number the collectives carry.
pub trait Elem: Copy + std::ops::AddAssign + Default {
    const SIZE: usize;
    fn put(self, out: &mut [u8]);
    fn get(bytes: &[u8]) -> Self;
}

impl Elem for f32 {
    const SIZE: usize = 4;
    fn put(self, out: &mut [u8]) {
        out.copy_from_slice(&self.to_le_bytes());
    }
    fn get(bytes: &[u8]) -> Self {
        f32::from_le_bytes(bytes.try_into().expect("4 bytes"))
    }
}

impl Elem for u8 {
    const SIZE: usize = 1;
    fn put(self, out: &mut [u8]) {
        out[0] = self;
    }
    fn get(bytes: &[u8]) -> Self {
        bytes[0]
    }
}

impl Elem for f64 {
    const SIZE: usize = 8;
    fn put(self, out: &mut [u8]) {
        out.copy_from_slice(&self.to_le_bytes());
    }
    fn get(bytes: &[u8]) -> Self {
        f64::from_le_bytes(bytes.try_into().expect("8 bytes"))
    }
}

/// Every buffer's numbers, one after the other. Fixed-size pieces written in place
/// (not pushed one by one): the compiler turns this into a plain copy on
/// little-endian machines, which matters at tens of megabytes per step.
pub fn encode<E: Elem>(bufs: &[&mut [E]], out: &mut Vec<u8>) {
    out.clear();
    out.resize(bufs.iter().map(|b| b.len() * E::SIZE).sum(), 0);
    let mut chunks = out.chunks_exact_mut(E::SIZE);
    for b in bufs {
        for (&x, c) in b.iter().zip(&mut chunks) {
            x.put(c);
        }
    }
}

/// `bufs[i] += payload` (`add`) or `bufs[i] = payload`, piece by piece.
pub fn decode_into<E: Elem>(payload: &[u8], bufs: &mut [&mut [E]], add: bool) {
    let mut chunks = payload.chunks_exact(E::SIZE);
    for b in bufs.iter_mut() {
        for (x, c) in b.iter_mut().zip(&mut chunks) {
            let v = E::get(c);
            if add {
                *x += v;
            } else {
                *x = v;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_reads_back_as_written_and_garbage_is_refused() {
        let mut bytes = Vec::new();
        write_frame(&mut bytes, Tag::Contribute, 7, 3, b"abc").unwrap();
        let f = read_frame(&mut bytes.as_slice(), Vec::new()).unwrap();
        assert_eq!(
            (f.tag, f.seq, f.flags, f.payload.as_slice()),
            (Tag::Contribute, 7, 3, &b"abc"[..])
        );
        let http = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
        assert!(read_frame(&mut http.as_slice(), Vec::new()).is_err());
        // A header promising more than arrives is an error, not a hang.
        assert!(read_frame(&mut &bytes[..22], Vec::new()).is_err());
    }

    #[test]
    fn numbers_round_trip_and_add_in_place() {
        let (mut a, mut b) = (vec![1.5f32, -2.0], vec![3.25f32]);
        let mut out = Vec::new();
        encode(&[a.as_mut_slice(), b.as_mut_slice()], &mut out);
        assert_eq!(out.len(), 12);
        let (mut x, mut y) = (vec![1.0f32, 1.0], vec![1.0f32]);
        decode_into(&out, &mut [x.as_mut_slice(), y.as_mut_slice()], true);
        assert_eq!((x, y), (vec![2.5, -1.0], vec![4.25]));
        decode_into(&out, &mut [a.as_mut_slice(), b.as_mut_slice()], false);
        assert_eq!((a, b), (vec![1.5, -2.0], vec![3.25]));
    }
}
