//! The ELF checks and the one patch a package's model library gets before it is loaded: its
//! loaded segments must lie within the file, and a library that needs `libtorch.so` is made to
//! need `libtorch_cpu.so` instead.
use std::path::Path;

/// Checks that an ELF64 library's loaded segments lie within it, and makes one that needs
/// `libtorch.so` need `libtorch_cpu.so` instead (which it needs
/// too, and which is what a CPU model calls: the shim's `aoti_torch_*`). Nothing else changes; a
/// library that does not name `libtorch.so` is left as it is.
pub fn needs_cpu_library(elf: &mut [u8]) -> Result<(), String> {
    fn field<const N: usize>(b: &[u8], at: usize, plus: usize) -> Result<[u8; N], String> {
        let start = at.checked_add(plus).ok_or("an offset is out of range")?;
        let end = start.checked_add(N).ok_or("an offset is out of range")?;
        b.get(start..end).and_then(|s| s.try_into().ok()).ok_or_else(|| "truncated".to_string())
    }
    let u16_at = |b: &[u8], at: usize| field::<2>(b, at, 0).map(u16::from_le_bytes);
    let u32_at = |b: &[u8], at: usize, plus: usize| field::<4>(b, at, plus).map(u32::from_le_bytes);
    let u64_at = |b: &[u8], at: usize, plus: usize| field::<8>(b, at, plus).map(u64::from_le_bytes);
    if elf.get(..6) != Some(&[0x7f, b'E', b'L', b'F', 2, 1]) {
        return Err("not a 64-bit little-endian ELF file".into());
    }
    let (phoff, phentsize, phnum) =
        (u64_at(elf, 0x20, 0)? as usize, u16_at(elf, 0x36)? as usize, u16_at(elf, 0x38)? as usize);
    if phentsize < 56 {
        return Err("its program headers are malformed".into());
    }
    // (type, offset, vaddr, filesz) of each program header.
    let mut headers = Vec::with_capacity(phnum);
    for k in 0..phnum {
        let at = phoff.checked_add(k * phentsize).ok_or("its program headers are malformed")?;
        headers.push((u32_at(elf, at, 0)?, u64_at(elf, at, 8)?, u64_at(elf, at, 16)?, u64_at(elf, at, 32)?));
    }
    // A segment past the end of the file would fault when touched (a truncated library).
    if headers.iter().any(|h| h.0 == 1 && h.1.checked_add(h.3).is_none_or(|end| end > elf.len() as u64)) {
        return Err("its loaded segments reach past the end of the file (is it truncated?)".into());
    }
    let Some(&(_, dyn_off, _, dyn_size)) = headers.iter().find(|h| h.0 == 2) else {
        return Err("it has no dynamic section".into());
    };
    let file_offset = |vaddr: u64| {
        headers
            .iter()
            .find(|h| h.0 == 1 && vaddr >= h.2 && vaddr - h.2 < h.3)
            .and_then(|h| (vaddr - h.2).checked_add(h.1))
            .map(|o| o as usize)
    };
    let mut entries = Vec::new();
    let end = dyn_off.saturating_add(dyn_size).min(elf.len() as u64) as usize;
    let mut at = dyn_off as usize;
    while at.saturating_add(16) <= end {
        let (tag, val) = (u64_at(elf, at, 0)?, u64_at(elf, at, 8)?);
        if tag == 0 {
            break;
        }
        entries.push((at, tag, val));
        at += 16;
    }
    let strtab = entries.iter().find(|e| e.1 == 5).and_then(|e| file_offset(e.2)).ok_or("it has no string table")?;
    let name = |offset: u64| -> Option<&[u8]> {
        let start = strtab.checked_add(offset as usize)?;
        let rest = elf.get(start..)?;
        rest.iter().position(|&b| b == 0).map(|n| &rest[..n])
    };
    let needed: Vec<(usize, u64, Vec<u8>)> = entries
        .iter()
        .filter(|e| e.1 == 1)
        .map(|e| Ok((e.0, e.2, name(e.2).ok_or("a needed library's name is outside the file")?.to_vec())))
        .collect::<Result<_, String>>()?;
    let Some(cpu) = needed.iter().find(|n| n.2 == b"libtorch_cpu.so").map(|n| n.1) else {
        return Ok(());
    };
    for (at, _, n) in &needed {
        if n == b"libtorch.so" {
            elf[at + 8..at + 16].copy_from_slice(&cpu.to_le_bytes());
        }
    }
    Ok(())
}

/// `needs_cpu_library` on a library file, in place (mapped, not read into memory: its weights
/// can be gigabytes).
pub fn patch_file(path: &Path) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let file = std::fs::OpenOptions::new().read(true).write(true).open(path).map_err(|e| e.to_string())?;
    let len = file.metadata().map_err(|e| e.to_string())?.len() as usize;
    if len == 0 {
        return Err("it is empty".into());
    }
    // SAFETY: a private shared mapping of a file only this process has, unmapped below.
    let at = unsafe {
        libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, file.as_raw_fd(), 0)
    };
    if at == libc::MAP_FAILED {
        return Err(format!("cannot map it: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: the mapping is len bytes, readable and writable, and nothing else touches it.
    let result = needs_cpu_library(unsafe { std::slice::from_raw_parts_mut(at as *mut u8, len) });
    // SAFETY: unmaps what was mapped above.
    unsafe { libc::munmap(at, len) };
    result
}

#[cfg(test)]
pub mod tests {
    use super::*;

    /// A minimal ELF64 library: one PT_LOAD over the file, one PT_DYNAMIC, a string table, and
    /// the needed libraries given.
    pub fn elf(needed: &[&str]) -> Vec<u8> {
        let mut strtab = vec![0u8];
        let mut offsets = Vec::new();
        for n in needed {
            offsets.push(strtab.len() as u64);
            strtab.extend_from_slice(n.as_bytes());
            strtab.push(0);
        }
        let (phoff, dyn_off) = (64usize, 64 + 2 * 56);
        let dyn_len = (needed.len() + 2) * 16;
        let str_off = dyn_off + dyn_len;
        let mut b = vec![0u8; str_off + strtab.len()];
        b[..6].copy_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1]);
        b[0x20..0x28].copy_from_slice(&(phoff as u64).to_le_bytes());
        b[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        b[0x38..0x3a].copy_from_slice(&2u16.to_le_bytes());
        let total = b.len() as u64;
        let ph = |b: &mut Vec<u8>, at: usize, kind: u32, off: u64, vaddr: u64, size: u64| {
            b[at..at + 4].copy_from_slice(&kind.to_le_bytes());
            b[at + 8..at + 16].copy_from_slice(&off.to_le_bytes());
            b[at + 16..at + 24].copy_from_slice(&vaddr.to_le_bytes());
            b[at + 32..at + 40].copy_from_slice(&size.to_le_bytes());
        };
        // Loaded at 0x1000 above its file offsets.
        ph(&mut b, phoff, 1, 0, 0x1000, total);
        ph(&mut b, phoff + 56, 2, dyn_off as u64, 0x1000 + dyn_off as u64, dyn_len as u64);
        let mut at = dyn_off;
        for o in &offsets {
            b[at..at + 8].copy_from_slice(&1u64.to_le_bytes());
            b[at + 8..at + 16].copy_from_slice(&o.to_le_bytes());
            at += 16;
        }
        b[at..at + 8].copy_from_slice(&5u64.to_le_bytes());
        b[at + 8..at + 16].copy_from_slice(&(0x1000 + str_off as u64).to_le_bytes());
        b[str_off..].copy_from_slice(&strtab);
        b
    }

    pub fn needed_names(b: &mut [u8]) -> Vec<String> {
        // Reads back through the same walk: patch nothing (no libtorch_cpu.so named) then list.
        let dyn_off = 64 + 2 * 56;
        let mut names = Vec::new();
        let mut at = dyn_off;
        let str_vaddr = loop {
            let tag = u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
            if tag == 5 {
                break u64::from_le_bytes(b[at + 8..at + 16].try_into().unwrap());
            }
            at += 16;
        };
        let strtab = (str_vaddr - 0x1000) as usize;
        let mut at = dyn_off;
        loop {
            let tag = u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
            if tag != 1 {
                break;
            }
            let off = u64::from_le_bytes(b[at + 8..at + 16].try_into().unwrap()) as usize;
            let end = b[strtab + off..].iter().position(|&c| c == 0).unwrap();
            names.push(String::from_utf8(b[strtab + off..strtab + off + end].to_vec()).unwrap());
            at += 16;
        }
        names
    }

    #[test]
    fn libtorch_becomes_libtorch_cpu() {
        let mut b = elf(&["libtorch.so", "libtorch_cpu.so", "libc.so.6"]);
        needs_cpu_library(&mut b).unwrap();
        assert_eq!(needed_names(&mut b), ["libtorch_cpu.so", "libtorch_cpu.so", "libc.so.6"]);
    }

    #[test]
    fn a_library_without_libtorch_is_left_alone() {
        let mut b = elf(&["libc.so.6"]);
        let before = b.clone();
        needs_cpu_library(&mut b).unwrap();
        assert_eq!(b, before);
        // libtorch.so alone (no libtorch_cpu.so to point at) stays too.
        let mut b = elf(&["libtorch.so"]);
        needs_cpu_library(&mut b).unwrap();
        assert_eq!(needed_names(&mut b), ["libtorch.so"]);
    }

    #[test]
    fn truncated_or_foreign_files_are_errors_not_panics() {
        let whole = elf(&["libtorch.so", "libtorch_cpu.so"]);
        for n in 0..whole.len() {
            let mut part = whole[..n].to_vec();
            assert!(needs_cpu_library(&mut part).is_err(), "{n} bytes");
        }
        assert!(needs_cpu_library(&mut b"#!/bin/sh\n".to_vec()).is_err());
        // Program headers claimed far past the end.
        let mut b = whole.clone();
        b[0x38..0x3a].copy_from_slice(&u16::MAX.to_le_bytes());
        assert!(needs_cpu_library(&mut b).is_err());
        let mut b = whole;
        b[0x20..0x28].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(needs_cpu_library(&mut b).is_err());
    }
}
