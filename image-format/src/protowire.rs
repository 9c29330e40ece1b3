//! A minimal protobuf wire-format reader: picks varint and length-delimited fields out of a
//! message without generated types (CRIU's statistics images; containerd's metrics in the
//! tests). Fixed-width fields are skipped. Nothing here panics on hostile input: a truncated or
//! malformed message is `None`.

/// One field's value.
pub enum Value<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
}

/// The varint and length-delimited fields of `msg`, as (field number, value), in order.
pub fn fields(msg: &[u8]) -> Option<Vec<(u64, Value<'_>)>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < msg.len() {
        let (key, n) = varint(&msg[i..])?;
        i += n;
        match key & 7 {
            0 => {
                let (v, n) = varint(&msg[i..])?;
                i += n;
                out.push((key >> 3, Value::Varint(v)));
            }
            1 => i = i.checked_add(8).filter(|&e| e <= msg.len())?,
            2 => {
                let (len, n) = varint(&msg[i..])?;
                i += n;
                let end = i.checked_add(usize::try_from(len).ok()?)?;
                out.push((key >> 3, Value::Bytes(msg.get(i..end)?)));
                i = end;
            }
            5 => i = i.checked_add(4).filter(|&e| e <= msg.len())?,
            _ => return None,
        }
    }
    Some(out)
}

/// The varint field `n` (the last one, as protobuf reads a repeated scalar).
pub fn varint_field(fields: &[(u64, Value<'_>)], n: u64) -> Option<u64> {
    fields.iter().rev().find_map(|(k, v)| match v {
        Value::Varint(x) if *k == n => Some(*x),
        _ => None,
    })
}

/// The length-delimited field `n` (the last one).
pub fn bytes_field<'a>(fields: &[(u64, Value<'a>)], n: u64) -> Option<&'a [u8]> {
    fields.iter().rev().find_map(|(k, v)| match v {
        Value::Bytes(b) if *k == n => Some(*b),
        _ => None,
    })
}

/// A varint at the start of `b`: its value and its length in bytes.
pub(crate) fn varint(b: &[u8]) -> Option<(u64, usize)> {
    let mut v = 0u64;
    for (i, byte) in b.iter().enumerate().take(10) {
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((v, i + 1));
        }
    }
    None
}

/// Appends `v` as a varint: the writing twin of [`varint`], for tests that build messages.
#[doc(hidden)]
pub fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_read_and_truncation_is_none() {
        // field 1 varint 300, field 2 bytes "ab", field 3 fixed32, field 1 varint 7 again.
        let msg = [
            0x08, 0xac, 0x02, 0x12, 2, b'a', b'b', 0x1d, 1, 2, 3, 4, 0x08, 7,
        ];
        let f = fields(&msg).unwrap();
        assert_eq!(varint_field(&f, 1), Some(7));
        assert_eq!(bytes_field(&f, 2), Some(&b"ab"[..]));
        assert_eq!(varint_field(&f, 3), None);
        assert!(fields(&msg[..6]).is_none());
        assert!(fields(&msg[..10]).is_none());
        assert!(
            fields(&[0x12, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]).is_none()
        );
    }
}
