//! Headers kept byte-exact in one blob, as every store saves them: for each header, the name's
//! length and bytes, then the value's length and bytes (lengths as 4-byte little-endian). JSON
//! would have to re-encode values that are not UTF-8; this keeps every byte as received, and
//! one format for every backend.

use crate::store::Header;

/// Encodes headers into one blob, byte-exact.
pub fn encode(headers: &[Header]) -> Vec<u8> {
    let len = headers.iter().map(|(n, v)| 8 + n.len() + v.len()).sum();
    let mut out = Vec::with_capacity(len);
    for (name, value) in headers {
        out.extend_from_slice(&(name.len() as u32).to_le_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&(value.len() as u32).to_le_bytes());
        out.extend_from_slice(value);
    }
    out
}

/// Decodes [`encode`]'s output; a damaged blob yields the headers before the damage.
pub fn decode(mut blob: &[u8]) -> Vec<Header> {
    fn take<'a>(blob: &mut &'a [u8]) -> Option<&'a [u8]> {
        let len = u32::from_le_bytes(blob.get(..4)?.try_into().ok()?) as usize;
        let bytes = blob.get(4..4 + len)?;
        *blob = &blob[4 + len..];
        Some(bytes)
    }
    let mut out = Vec::new();
    while !blob.is_empty() {
        let (Some(name), Some(value)) = (take(&mut blob), take(&mut blob)) else {
            break;
        };
        out.push((String::from_utf8_lossy(name).into_owned(), value.to_vec()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_non_utf8_values() {
        let headers = vec![
            ("stripe-signature".to_owned(), b"t=1,v1=ab".to_vec()),
            ("x-odd".to_owned(), vec![0xff, 0x00, 0x80]),
            ("empty".to_owned(), vec![]),
        ];
        assert_eq!(decode(&encode(&headers)), headers);
        assert!(decode(&[1, 2]).is_empty());
    }
}
