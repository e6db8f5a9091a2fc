//! A small, defensive msgpack reader and writer.
//!
//! KV events come from engines we do not control, so decoding must never panic, never allocate more
//! than the input justifies, and tolerate fields we do not know. A generic value tree with explicit
//! caps (depth, element counts bounded by the remaining bytes) gives that without trusting serde's
//! derived visitors, and lets the event layer accept both the map and the legacy array forms.

/// A decoded msgpack value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// nil
    Nil,
    /// true / false
    Bool(bool),
    /// Any integer; msgpack ints span i64 ∪ u64.
    Int(i128),
    /// float32 or float64
    Float(f64),
    /// UTF-8 string (invalid UTF-8 is replaced, not rejected)
    Str(String),
    /// Binary data
    Bin(Vec<u8>),
    /// Array
    Array(Vec<Value>),
    /// Map, in wire order
    Map(Vec<(Value, Value)>),
    /// Extension type (tag, data)
    Ext(i8, Vec<u8>),
}

impl Value {
    /// The value of `key` in a map with string keys.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Map(entries) => entries
                .iter()
                .find(|(k, _)| matches!(k, Value::Str(s) if s == key))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// Why bytes are not valid msgpack.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MsgpackError {
    /// The input ended inside a value.
    #[error("truncated msgpack at byte {0}")]
    Truncated(usize),
    /// 0xc1 is never used.
    #[error("reserved msgpack marker 0xc1 at byte {0}")]
    Reserved(usize),
    /// Nesting deeper than [`MAX_DEPTH`].
    #[error("msgpack nesting deeper than {MAX_DEPTH}")]
    TooDeep,
    /// An array/map claims more elements than the remaining bytes could hold.
    #[error("msgpack length {0} at byte {1} exceeds the remaining input")]
    TooLong(usize, usize),
    /// Bytes after the top-level value.
    #[error("{0} trailing bytes after the msgpack value")]
    Trailing(usize),
    /// More than [`MAX_VALUES`] values in one message.
    #[error("more than {MAX_VALUES} msgpack values in one message")]
    TooMany,
}

/// Deepest nesting accepted; KV events need 5.
pub const MAX_DEPTH: usize = 32;

/// Most values decoded from one input (1 Mi): a one-byte value takes a
/// `size_of::<Value>()`-byte slot in the tree, so without it a 4 MiB message of small ints
/// would take ~128 MiB. A batch storing a 128k-token prompt's blocks with their token ids holds
/// ~140k values.
pub const MAX_VALUES: usize = 1 << 20;

/// Decodes exactly one value spanning all of `input`.
pub fn decode(input: &[u8]) -> Result<Value, MsgpackError> {
    let mut r = Reader {
        buf: input,
        pos: 0,
        values_left: MAX_VALUES,
    };
    let v = r.value(0)?;
    if r.pos != input.len() {
        return Err(MsgpackError::Trailing(input.len() - r.pos));
    }
    Ok(v)
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Values still allowed ([`MAX_VALUES`] at the start).
    values_left: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], MsgpackError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.buf.len())
            .ok_or(MsgpackError::Truncated(self.pos))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], MsgpackError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn len(&mut self, width: usize) -> Result<usize, MsgpackError> {
        Ok(match width {
            1 => self.be::<1>()?[0] as usize,
            2 => u16::from_be_bytes(self.be()?) as usize,
            _ => u32::from_be_bytes(self.be()?) as usize,
        })
    }

    fn count(&mut self, n: usize, min_bytes_each: usize) -> Result<usize, MsgpackError> {
        let remaining = self.buf.len() - self.pos;
        if n.saturating_mul(min_bytes_each) > remaining {
            return Err(MsgpackError::TooLong(n, self.pos));
        }
        Ok(n)
    }

    fn str(&mut self, n: usize) -> Result<Value, MsgpackError> {
        Ok(Value::Str(
            String::from_utf8_lossy(self.take(n)?).into_owned(),
        ))
    }

    fn array(&mut self, n: usize, depth: usize) -> Result<Value, MsgpackError> {
        let n = self.count(n, 1)?;
        // No more room than the values still allowed: the count is the sender's word.
        let mut items = Vec::with_capacity(n.min(self.values_left));
        for _ in 0..n {
            items.push(self.value(depth + 1)?);
        }
        Ok(Value::Array(items))
    }

    fn map(&mut self, n: usize, depth: usize) -> Result<Value, MsgpackError> {
        let n = self.count(n, 2)?;
        let mut items = Vec::with_capacity(n.min(self.values_left / 2));
        for _ in 0..n {
            let k = self.value(depth + 1)?;
            let v = self.value(depth + 1)?;
            items.push((k, v));
        }
        Ok(Value::Map(items))
    }

    fn ext(&mut self, n: usize) -> Result<Value, MsgpackError> {
        let tag = self.be::<1>()?[0] as i8;
        Ok(Value::Ext(tag, self.take(n)?.to_vec()))
    }

    fn value(&mut self, depth: usize) -> Result<Value, MsgpackError> {
        if depth > MAX_DEPTH {
            return Err(MsgpackError::TooDeep);
        }
        self.values_left = self
            .values_left
            .checked_sub(1)
            .ok_or(MsgpackError::TooMany)?;
        let at = self.pos;
        let m = self.be::<1>()?[0];
        Ok(match m {
            0x00..=0x7f => Value::Int(m as i128),
            0x80..=0x8f => self.map((m & 0x0f) as usize, depth)?,
            0x90..=0x9f => self.array((m & 0x0f) as usize, depth)?,
            0xa0..=0xbf => self.str((m & 0x1f) as usize)?,
            0xc0 => Value::Nil,
            0xc1 => return Err(MsgpackError::Reserved(at)),
            0xc2 => Value::Bool(false),
            0xc3 => Value::Bool(true),
            0xc4..=0xc6 => {
                let n = self.len(1 << (m - 0xc4))?;
                Value::Bin(self.take(n)?.to_vec())
            }
            0xc7..=0xc9 => {
                let n = self.len(1 << (m - 0xc7))?;
                self.ext(n)?
            }
            0xca => Value::Float(f32::from_be_bytes(self.be()?) as f64),
            0xcb => Value::Float(f64::from_be_bytes(self.be()?)),
            0xcc => Value::Int(self.be::<1>()?[0] as i128),
            0xcd => Value::Int(u16::from_be_bytes(self.be()?) as i128),
            0xce => Value::Int(u32::from_be_bytes(self.be()?) as i128),
            0xcf => Value::Int(u64::from_be_bytes(self.be()?) as i128),
            0xd0 => Value::Int(self.be::<1>()?[0] as i8 as i128),
            0xd1 => Value::Int(i16::from_be_bytes(self.be()?) as i128),
            0xd2 => Value::Int(i32::from_be_bytes(self.be()?) as i128),
            0xd3 => Value::Int(i64::from_be_bytes(self.be()?) as i128),
            0xd4..=0xd8 => self.ext(1 << (m - 0xd4))?,
            0xd9..=0xdb => {
                let n = self.len(1 << (m - 0xd9))?;
                self.str(n)?
            }
            0xdc | 0xdd => {
                let n = self.len(if m == 0xdc { 2 } else { 4 })?;
                self.array(n, depth)?
            }
            0xde | 0xdf => {
                let n = self.len(if m == 0xde { 2 } else { 4 })?;
                self.map(n, depth)?
            }
            0xe0..=0xff => Value::Int(m as i8 as i128),
        })
    }
}

/// Appends the shortest encoding of `v` (as msgspec and msgpack-python do).
pub fn write_int(out: &mut Vec<u8>, v: i128) {
    if v >= 0 {
        let u = v.min(u64::MAX as i128) as u64;
        match u {
            0..=0x7f => out.push(u as u8),
            0x80..=0xff => out.extend_from_slice(&[0xcc, u as u8]),
            0x100..=0xffff => {
                out.push(0xcd);
                out.extend_from_slice(&(u as u16).to_be_bytes());
            }
            0x1_0000..=0xffff_ffff => {
                out.push(0xce);
                out.extend_from_slice(&(u as u32).to_be_bytes());
            }
            _ => {
                out.push(0xcf);
                out.extend_from_slice(&u.to_be_bytes());
            }
        }
    } else {
        let i = v.max(i64::MIN as i128) as i64;
        match i {
            -32..=-1 => out.push(i as i8 as u8),
            -128..=-33 => out.extend_from_slice(&[0xd0, i as i8 as u8]),
            -32768..=-129 => {
                out.push(0xd1);
                out.extend_from_slice(&(i as i16).to_be_bytes());
            }
            -2_147_483_648..=-32769 => {
                out.push(0xd2);
                out.extend_from_slice(&(i as i32).to_be_bytes());
            }
            _ => {
                out.push(0xd3);
                out.extend_from_slice(&i.to_be_bytes());
            }
        }
    }
}

fn write_len(out: &mut Vec<u8>, n: usize, fix: u8, fix_max: usize, m16: u8, m32: u8) {
    if n <= fix_max {
        out.push(fix | n as u8);
    } else if n <= 0xffff {
        out.push(m16);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(m32);
        out.extend_from_slice(&(n.min(u32::MAX as usize) as u32).to_be_bytes());
    }
}

/// Appends an array header for `n` elements.
pub fn write_array_len(out: &mut Vec<u8>, n: usize) {
    write_len(out, n, 0x90, 15, 0xdc, 0xdd);
}

/// Appends a map header for `n` pairs.
pub fn write_map_len(out: &mut Vec<u8>, n: usize) {
    write_len(out, n, 0x80, 15, 0xde, 0xdf);
}

/// Appends a string.
pub fn write_str(out: &mut Vec<u8>, s: &str) {
    if s.len() <= 31 {
        out.push(0xa0 | s.len() as u8);
    } else if s.len() <= 0xff {
        out.extend_from_slice(&[0xd9, s.len() as u8]);
    } else {
        write_len(out, s.len(), 0, 0, 0xda, 0xdb);
    }
    out.extend_from_slice(s.as_bytes());
}

/// Appends nil.
pub fn write_nil(out: &mut Vec<u8>) {
    out.push(0xc0);
}

/// Appends a float64 (vLLM's `ts` is always float64).
pub fn write_f64(out: &mut Vec<u8>, v: f64) {
    out.push(0xcb);
    out.extend_from_slice(&v.to_be_bytes());
}

/// Appends any value.
pub fn write_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::Nil => write_nil(out),
        Value::Bool(b) => out.push(if *b { 0xc3 } else { 0xc2 }),
        Value::Int(i) => write_int(out, *i),
        Value::Float(f) => write_f64(out, *f),
        Value::Str(s) => write_str(out, s),
        Value::Bin(b) => {
            if b.len() <= 0xff {
                out.extend_from_slice(&[0xc4, b.len() as u8]);
            } else {
                write_len(out, b.len(), 0, 0, 0xc5, 0xc6);
            }
            out.extend_from_slice(b);
        }
        Value::Array(items) => {
            write_array_len(out, items.len());
            for item in items {
                write_value(out, item);
            }
        }
        Value::Map(entries) => {
            write_map_len(out, entries.len());
            for (k, val) in entries {
                write_value(out, k);
                write_value(out, val);
            }
        }
        Value::Ext(tag, data) => {
            match data.len() {
                1 => out.push(0xd4),
                2 => out.push(0xd5),
                4 => out.push(0xd6),
                8 => out.push(0xd7),
                16 => out.push(0xd8),
                n if n <= 0xff => out.extend_from_slice(&[0xc7, n as u8]),
                n if n <= 0xffff => {
                    out.push(0xc8);
                    out.extend_from_slice(&(n as u16).to_be_bytes());
                }
                n => {
                    out.push(0xc9);
                    out.extend_from_slice(&(n.min(u32::MAX as usize) as u32).to_be_bytes());
                }
            }
            out.push(*tag as u8);
            out.extend_from_slice(data);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ints_round_trip_in_shortest_form() {
        for v in [
            0i128,
            1,
            127,
            128,
            255,
            256,
            65535,
            65536,
            u32::MAX as i128,
            u64::MAX as i128,
            -1,
            -32,
            -33,
            -129,
            -40000,
            i64::MIN as i128,
        ] {
            let mut out = Vec::new();
            write_int(&mut out, v);
            assert_eq!(decode(&out), Ok(Value::Int(v)), "{v}");
        }
        let mut out = Vec::new();
        write_int(&mut out, u64::MAX as i128);
        assert_eq!(out, [0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
    }

    #[test]
    fn rejects_lengths_beyond_input() {
        assert!(matches!(
            decode(&[0xdd, 0xff, 0xff, 0xff, 0xff]),
            Err(MsgpackError::TooLong(..))
        ));
        assert!(matches!(
            decode(&[0xcd, 0x01]),
            Err(MsgpackError::Truncated(_))
        ));
        assert!(matches!(decode(&[0x91]), Err(MsgpackError::TooLong(..))));
        let deep = vec![0x91u8; 100];
        assert_eq!(decode(&deep), Err(MsgpackError::TooDeep));
    }

    #[test]
    fn a_message_holds_at_most_max_values() {
        // An array32 of `n` one-byte ints.
        let ints = |n: usize| {
            let mut b = vec![0xdd];
            b.extend_from_slice(&(n as u32).to_be_bytes());
            b.resize(5 + n, 0x01);
            b
        };
        // The array itself is one value.
        assert!(decode(&ints(MAX_VALUES - 1)).is_ok());
        assert_eq!(decode(&ints(MAX_VALUES)), Err(MsgpackError::TooMany));
    }
}
