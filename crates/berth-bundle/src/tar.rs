//! The bundle's tar: written deterministically (ustar, sorted, regular files only, mode 0644,
//! mtime and owners 0), read in memory with every header checked before its data is touched.
//!
//! The reader is ours, not the `tar` crate's, so that every entry type is decided here: regular
//! files are kept, directories skipped, GNU long names (`L`) and pax headers (`x`, `g`) are
//! folded into the next member's name and size and then checked like any other name, and all
//! else (links, devices, fifos, sparse, volume headers, unknown types) is refused. Nothing is
//! written to disk.

use berth_proto::error::codes;

use crate::name::{self, unsafe_member};
use crate::{BundleError, Files, Limits};

const BLOCK: usize = 512;
/// A GNU long name or a pax header larger than this is refused before it is read.
const MAX_EXTENSION_BYTES: u64 = 64 * 1024;
/// The largest size an octal `size` field of 11 digits can hold.
const MAX_OCTAL_SIZE: u64 = 0o77777777777;

/// The deterministic ustar of `files`: same files, same bytes.
pub fn to_tar(files: &Files) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, content) in files {
        let size = content.len() as u64;
        let split = split_ustar_name(name);
        if split.is_none() || size > MAX_OCTAL_SIZE {
            // The name (or size) does not fit the ustar fields: a pax header carries it.
            let mut records = Vec::new();
            if split.is_none() {
                records.extend(pax_record("path", name));
            }
            if size > MAX_OCTAL_SIZE {
                records.extend(pax_record("size", &size.to_string()));
            }
            out.extend(header(b"././@PaxHeader", b"", records.len() as u64, b'x'));
            push_padded(&mut out, &records);
        }
        let (prefix, short) = split.unwrap_or((b"", b"pax-named"));
        out.extend(header(short, prefix, size.min(MAX_OCTAL_SIZE), b'0'));
        push_padded(&mut out, content);
    }
    out.extend([0u8; 2 * BLOCK]);
    out
}

/// ustar's (prefix, name) split of `name`: name ≤ 100 bytes, prefix ≤ 155, split at a '/'.
fn split_ustar_name(name: &str) -> Option<(&[u8], &[u8])> {
    let bytes = name.as_bytes();
    if bytes.len() <= 100 {
        return Some((b"", bytes));
    }
    bytes
        .iter()
        .enumerate()
        .filter(|(i, &b)| b == b'/' && *i <= 155 && bytes.len() - i - 1 <= 100 && *i > 0)
        .map(|(i, _)| (&bytes[..i], &bytes[i + 1..]))
        .next()
}

/// One pax record, `"<len> key=value\n"`, where `<len>` counts the whole record including itself.
fn pax_record(key: &str, value: &str) -> Vec<u8> {
    let body = format!(" {key}={value}\n");
    let mut len = body.len() + 1;
    while len.to_string().len() + body.len() != len {
        len = len.to_string().len() + body.len();
    }
    format!("{len}{body}").into_bytes()
}

fn header(name: &[u8], prefix: &[u8], size: u64, typeflag: u8) -> [u8; BLOCK] {
    let mut h = [0u8; BLOCK];
    h[..name.len()].copy_from_slice(name);
    h[100..108].copy_from_slice(b"0000644\0");
    h[108..116].copy_from_slice(b"0000000\0");
    h[116..124].copy_from_slice(b"0000000\0");
    h[124..136].copy_from_slice(format!("{size:011o}\0").as_bytes());
    h[136..148].copy_from_slice(b"00000000000\0");
    h[156] = typeflag;
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    h[345..345 + prefix.len()].copy_from_slice(prefix);
    h[148..156].copy_from_slice(b"        ");
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    h
}

fn push_padded(out: &mut Vec<u8>, data: &[u8]) {
    out.extend_from_slice(data);
    let rem = data.len() % BLOCK;
    if rem != 0 {
        out.extend(std::iter::repeat_n(0u8, BLOCK - rem));
    }
}

fn invalid(detail: impl Into<String>) -> BundleError {
    BundleError::new(codes::BUNDLE_INVALID, detail)
}

fn too_large(detail: impl Into<String>) -> BundleError {
    BundleError::new(codes::BUNDLE_TOO_LARGE, detail)
}

/// What `L`, `x` and `g` headers said about the member that follows them.
#[derive(Default)]
struct Pending {
    name: Option<Vec<u8>>,
    size: Option<u64>,
}

impl Pending {
    fn is_empty(&self) -> bool {
        self.name.is_none() && self.size.is_none()
    }
}

/// Reads `bytes` as a bundle tar, in memory; see the crate docs for what is refused.
pub fn read_tar(bytes: &[u8], limits: &Limits) -> Result<Files, BundleError> {
    let mut files = Files::new();
    let mut total: u64 = 0;
    let mut pending = Pending::default();
    let mut offset = 0usize;
    loop {
        let Some(block) = bytes.get(offset..offset + BLOCK) else {
            return Err(invalid(if offset == bytes.len() && offset > 0 {
                "the tar has no end-of-archive blocks"
            } else {
                "the tar is truncated in a header"
            }));
        };
        if block.iter().all(|&b| b == 0) {
            if !pending.is_empty() {
                return Err(invalid("an extended header is followed by no member"));
            }
            break;
        }
        let block: &[u8; BLOCK] = block.try_into().expect("a 512-byte slice");
        verify_checksum(block, offset)?;
        let typeflag = block[156];
        let raw_name = header_name(block);
        let shown = String::from_utf8_lossy(&raw_name).into_owned();
        let header_size = parse_size(&block[124..136])
            .ok_or_else(|| invalid(format!("member {shown:?}: unreadable size field")))?;
        if !matches!(typeflag, b'0' | b'\0' | b'5' | b'L' | b'x' | b'g') {
            // Refused on the header alone, whatever its size field claims.
            let raw = pending.name.take().unwrap_or(raw_name);
            return Err(unsafe_member(
                &String::from_utf8_lossy(&raw),
                entry_kind(typeflag),
            ));
        }
        let data_start = offset + BLOCK;
        let is_extension = matches!(typeflag, b'L' | b'x' | b'g');
        let size = if is_extension {
            header_size
        } else {
            pending.size.take().unwrap_or(header_size)
        };
        // Every size is checked before any data is read: a lying header costs nothing.
        if is_extension && size > MAX_EXTENSION_BYTES {
            return Err(too_large(format!(
                "an extended header of {size} bytes (at most {MAX_EXTENSION_BYTES})"
            )));
        }
        if matches!(typeflag, b'0' | b'\0') && size > limits.max_member_bytes {
            let name = pending.name.as_deref().unwrap_or(&raw_name);
            return Err(too_large(format!(
                "member {:?} is {size} bytes (at most {})",
                String::from_utf8_lossy(name),
                limits.max_member_bytes
            )));
        }
        let data_len = usize::try_from(size).map_err(|_| invalid("a size beyond memory"))?;
        let padded = data_len
            .checked_add((BLOCK - data_len % BLOCK) % BLOCK)
            .ok_or_else(|| invalid("a size beyond memory"))?;
        let next = data_start
            .checked_add(padded)
            .ok_or_else(|| invalid("a size beyond memory"))?;
        let data = bytes
            .get(data_start..data_start + data_len)
            .ok_or_else(|| invalid(format!("member {shown:?}: data truncated")))?;
        match typeflag {
            b'L' => {
                if pending.name.is_some() {
                    return Err(unsafe_member(&shown, "a second long name for one member"));
                }
                let mut long = data.to_vec();
                while long.last() == Some(&0) {
                    long.pop();
                }
                pending.name = Some(long);
            }
            b'x' | b'g' => {
                for (key, value) in parse_pax(data)? {
                    match key.as_str() {
                        "path" if typeflag == b'x' => {
                            if pending.name.is_some() {
                                return Err(unsafe_member(
                                    &String::from_utf8_lossy(&value),
                                    "a second long name for one member",
                                ));
                            }
                            pending.name = Some(value);
                        }
                        "size" if typeflag == b'x' => {
                            let text = std::str::from_utf8(&value).ok();
                            let size =
                                text.and_then(|t| t.parse::<u64>().ok()).ok_or_else(|| {
                                    invalid(format!("member {shown:?}: unreadable pax size"))
                                })?;
                            pending.size = Some(size);
                        }
                        // A global header may not rename or resize what follows; a sparse map
                        // or a link target means a member that is not a plain file.
                        "path" | "size" | "linkpath" => {
                            return Err(unsafe_member(
                                &shown,
                                &format!("pax header sets {key} (global or link)"),
                            ))
                        }
                        k if k.starts_with("GNU.sparse") => {
                            return Err(unsafe_member(&shown, "sparse file"))
                        }
                        _ => {}
                    }
                }
            }
            b'0' | b'\0' | b'5' => {
                let raw = pending.name.take().unwrap_or(raw_name);
                if typeflag == b'5' {
                    // Skipped, but its name must still be safe; `./` (the root) is.
                    match name::normalise(&raw) {
                        Ok(_) => {}
                        Err(why) if why == name::EMPTY => {}
                        Err(why) => {
                            return Err(unsafe_member(&String::from_utf8_lossy(&raw), &why))
                        }
                    }
                } else {
                    let name = name::checked(&raw)?;
                    if raw.ends_with(b"/") {
                        return Err(unsafe_member(
                            &name,
                            "a regular file named like a directory",
                        ));
                    }
                    if files.len() >= limits.max_members {
                        return Err(too_large(format!(
                            "more than {} members",
                            limits.max_members
                        )));
                    }
                    total = total.saturating_add(size);
                    if total > limits.max_total_bytes {
                        return Err(too_large(format!(
                            "members total more than {} bytes",
                            limits.max_total_bytes
                        )));
                    }
                    if files.insert(name.clone(), data.to_vec()).is_some() {
                        return Err(unsafe_member(&name, "duplicate name"));
                    }
                }
            }
            // Every other type was refused above.
            _ => {}
        }
        offset = next;
    }
    check_file_prefixes(&files)?;
    Ok(files)
}

/// A member `a/b` next to a member `a`: no directory tree can hold both.
pub(crate) fn check_file_prefixes(files: &Files) -> Result<(), BundleError> {
    for name in files.keys() {
        let mut end = 0;
        while let Some(i) = name[end..].find('/') {
            end += i;
            if files.contains_key(&name[..end]) {
                return Err(unsafe_member(
                    name,
                    &format!("{:?} is a file, not a directory", &name[..end]),
                ));
            }
            end += 1;
        }
    }
    Ok(())
}

fn entry_kind(typeflag: u8) -> &'static str {
    match typeflag {
        b'1' => "hard link",
        b'2' => "symbolic link",
        b'3' => "character device",
        b'4' => "block device",
        b'6' => "fifo",
        b'7' => "contiguous file (not a plain file)",
        b'K' => "long link name (a link)",
        b'S' => "sparse file",
        _ => "entry type that is not a regular file or directory",
    }
}

fn verify_checksum(block: &[u8; BLOCK], offset: usize) -> Result<(), BundleError> {
    let stored = parse_octal(&block[148..156])
        .ok_or_else(|| invalid(format!("not a tar header at byte {offset}")))?;
    let mut unsigned: u64 = 0;
    let mut signed: i64 = 0;
    for (i, &b) in block.iter().enumerate() {
        let b = if (148..156).contains(&i) { b' ' } else { b };
        unsigned += u64::from(b);
        signed += i64::from(b as i8);
    }
    if stored == unsigned || i64::try_from(stored).ok() == Some(signed) {
        Ok(())
    } else {
        Err(invalid(format!("bad header checksum at byte {offset}")))
    }
}

/// The header's own name: POSIX ustar joins `prefix/name`; GNU and v7 headers have no prefix.
fn header_name(block: &[u8; BLOCK]) -> Vec<u8> {
    let field = |f: &[u8]| -> Vec<u8> { f.iter().copied().take_while(|&b| b != 0).collect() };
    let name = field(&block[..100]);
    if &block[257..263] == b"ustar\0" {
        let prefix = field(&block[345..500]);
        if !prefix.is_empty() {
            let mut joined = prefix;
            joined.push(b'/');
            joined.extend(name);
            return joined;
        }
    }
    name
}

/// An octal field (spaces and NULs around it), or base-256 when its top bit is set.
fn parse_size(field: &[u8]) -> Option<u64> {
    if field[0] & 0x80 != 0 {
        if field[0] & 0x40 != 0 {
            return None; // negative
        }
        let mut value: u64 = u64::from(field[0] & 0x3f);
        for &b in &field[1..] {
            value = value.checked_mul(256)?.checked_add(u64::from(b))?;
        }
        return Some(value);
    }
    parse_octal(field)
}

fn parse_octal(field: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(field).ok()?;
    let text = text.trim_matches(|c| c == ' ' || c == '\0');
    if text.is_empty() {
        return Some(0);
    }
    u64::from_str_radix(text, 8).ok()
}

/// pax records `"<len> key=value\n"`; anything else is `BUNDLE_INVALID`.
fn parse_pax(mut data: &[u8]) -> Result<Vec<(String, Vec<u8>)>, BundleError> {
    let bad = || invalid("malformed pax header");
    let mut records = Vec::new();
    while !data.is_empty() {
        if data.iter().all(|&b| b == 0) {
            break;
        }
        let space = data.iter().position(|&b| b == b' ').ok_or_else(bad)?;
        let len: usize = std::str::from_utf8(&data[..space])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(bad)?;
        if len <= space + 1 || len > data.len() || data[len - 1] != b'\n' {
            return Err(bad());
        }
        let record = &data[space + 1..len - 1];
        let eq = record.iter().position(|&b| b == b'=').ok_or_else(bad)?;
        let key = String::from_utf8(record[..eq].to_vec()).map_err(|_| bad())?;
        records.push((key, record[eq + 1..].to_vec()));
        data = &data[len..];
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pax_record_length_counts_itself() {
        for value in ["a", &"x".repeat(93), &"y".repeat(994)] {
            let r = pax_record("path", value);
            let (len, _) = std::str::from_utf8(&r).unwrap().split_once(' ').unwrap();
            assert_eq!(len.parse::<usize>().unwrap(), r.len());
        }
    }

    #[test]
    fn long_names_split_or_go_to_pax() {
        let mut files = Files::new();
        files.insert(
            format!("{}/{}", "d".repeat(120), "f".repeat(90)),
            b"1".to_vec(),
        );
        files.insert("n".repeat(300), b"2".to_vec());
        files.insert(format!("{}/x", "p".repeat(200)), b"3".to_vec());
        let tar = to_tar(&files);
        assert_eq!(read_tar(&tar, &Limits::default()).unwrap(), files);
    }
}
