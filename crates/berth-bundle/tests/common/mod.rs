//! Hand-made tar headers: what a hostile server could send, byte for byte.

#![allow(dead_code)]

use berth_bundle::Files;

/// One raw 512-byte header; `size` is written as given (it may lie), the checksum is right.
pub fn header(name: &[u8], typeflag: u8, size: u64, linkname: &[u8]) -> [u8; 512] {
    let mut h = [0u8; 512];
    let n = name.len().min(100);
    h[..n].copy_from_slice(&name[..n]);
    h[100..108].copy_from_slice(b"0000644\0");
    h[108..116].copy_from_slice(b"0000000\0");
    h[116..124].copy_from_slice(b"0000000\0");
    h[124..136].copy_from_slice(format!("{:011o}\0", size & 0o77777777777).as_bytes());
    h[136..148].copy_from_slice(b"00000000000\0");
    h[156] = typeflag;
    let l = linkname.len().min(100);
    h[157..157 + l].copy_from_slice(&linkname[..l]);
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    h[148..156].copy_from_slice(b"        ");
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    h
}

/// A member: its header, then `data` padded to a block.
pub fn member(out: &mut Vec<u8>, name: &[u8], typeflag: u8, data: &[u8], linkname: &[u8]) {
    out.extend(header(name, typeflag, data.len() as u64, linkname));
    pad(out, data);
}

pub fn pad(out: &mut Vec<u8>, data: &[u8]) {
    out.extend_from_slice(data);
    let rem = data.len() % 512;
    if rem != 0 {
        out.extend(std::iter::repeat_n(0u8, 512 - rem));
    }
}

/// A pax record with its self-counting length.
pub fn pax_record(key: &str, value: &[u8]) -> Vec<u8> {
    let body_len = 1 + key.len() + 1 + value.len() + 1;
    let mut len = body_len + 1;
    while len.to_string().len() + body_len != len {
        len = len.to_string().len() + body_len;
    }
    let mut r = format!("{len} {key}=").into_bytes();
    r.extend_from_slice(value);
    r.push(b'\n');
    r
}

pub fn end(out: &mut Vec<u8>) {
    out.extend([0u8; 1024]);
}

pub fn files(items: &[(&str, &[u8])]) -> Files {
    items
        .iter()
        .map(|(n, c)| (n.to_string(), c.to_vec()))
        .collect()
}
