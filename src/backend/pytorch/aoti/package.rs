//! An AOTInductor package (`model.pt2`, a zip archive) opened for running in the server: its
//! compiled model library is copied out into a private folder (under its own fixed name, so no
//! name in the archive chooses where anything is written), with its metadata, and is made to need
//! `libtorch_cpu.so` where it names `libtorch.so` (which would bring PyTorch's CUDA libraries into
//! a CPU server). Its kernels' sources are read for checks inside OpenMP regions: an exception
//! there ends the process (`std::terminate`), so such a package runs in a process of its own.
use std::{
    collections::HashMap,
    io::{Read, Write},
    path::Path,
};

use sha2::{Digest, Sha256};

use super::elf;

/// Where a package's compiled model sits in the archive (`<archive>/data/aotinductor/model/`).
const MODEL_DIR: &str = "data/aotinductor/model/";
/// Entries a package may have.
const MAX_ENTRIES: usize = 100_000;
/// The largest metadata file read.
const MAX_METADATA: u64 = 1 << 20;
/// The largest source file read (generated kernels of a large model run to megabytes).
const MAX_SOURCE: u64 = 256 << 20;
/// The largest model library taken out, whatever the archive's size (its weights are in it).
const MAX_LIBRARY: u64 = 64 << 30;

/// What was taken out of a package.
#[derive(Debug)]
pub struct Opened {
    /// The private folder holding `model.so`.
    pub dir: tempfile::TempDir,
    pub library: std::path::PathBuf,
    /// SHA-256 of the library as the package holds it.
    pub digest: String,
    /// The fewest rows its inputs' first dimension takes, as its input checks say (1: any).
    pub least_rows: i64,
    /// The package's metadata (`AOTI_DEVICE_KEY`, `AOTI_CPU_ISA`, ...).
    pub metadata: HashMap<String, String>,
}

/// Why a package is not run in the server, but by a PyTorch process (which handles every form
/// PyTorch writes).
#[derive(Debug, PartialEq)]
pub enum Refusal {
    /// A form the in-server path does not take; the reason, for the log.
    Elsewhere(String),
    /// The file is not a package that could run anywhere.
    Broken(String),
}

/// The entries that matter, by index.
#[derive(Default)]
struct Found {
    library: Option<usize>,
    metadata: Option<usize>,
    sources: Vec<usize>,
    elsewhere: Option<String>,
}

fn survey(zip: &mut zip::ZipArchive<std::io::BufReader<std::fs::File>>) -> Found {
    let mut found = Found::default();
    for k in 0..zip.len() {
        let name = zip.name_for_index(k).and_then(Result::ok).map(|n| n.to_string()).unwrap_or_default();
        let Some(within) = model_entry(&name) else {
            if name.contains("data/weights/") || name.contains("data/constants/") {
                found.elsewhere = Some("its weights are stored apart from the compiled model".to_string());
            }
            continue;
        };
        if within.contains('/') {
            continue;
        }
        if within.ends_with(".so") {
            if found.library.replace(k).is_some() {
                found.elsewhere = Some("it holds more than one compiled model library".into());
            }
        } else if within.ends_with(".cpp") {
            found.sources.push(k);
        } else if within.ends_with("_metadata.json") && (found.metadata.is_none() || within.contains("wrapper")) {
            found.metadata = Some(k);
        }
    }
    found
}

pub fn open(path: &Path) -> Result<Opened, Refusal> {
    let broken = |e: String| Refusal::Broken(format!("'{}' is not an AOTInductor package: {e}", path.display()));
    let file = std::fs::File::open(path).map_err(|e| broken(e.to_string()))?;
    let mut zip = zip::ZipArchive::new(std::io::BufReader::new(file)).map_err(|e| broken(e.to_string()))?;
    if zip.len() > MAX_ENTRIES {
        return Err(broken(format!("it has {} entries (at most {MAX_ENTRIES})", zip.len())));
    }
    let found = survey(&mut zip);
    let Some(library) = found.library else {
        return Err(Refusal::Elsewhere(
            "it holds no compiled model library (PyTorch compiles it when it loads)".into(),
        ));
    };
    if let Some(why) = found.elsewhere {
        return Err(Refusal::Elsewhere(why));
    }
    if found.sources.is_empty() {
        return Err(Refusal::Elsewhere(
            "it carries no kernel sources to show that no check throws inside a parallel region".into(),
        ));
    }
    let mut least_rows = 1;
    for &k in &found.sources {
        let mut text = String::new();
        let entry = zip.by_index(k).map_err(|e| broken(e.to_string()))?;
        entry.take(MAX_SOURCE).read_to_string(&mut text).map_err(|e| broken(format!("its sources: {e}")))?;
        least_rows = least_rows.max(least_first_dim(&text));
        if divides_integers(&text) {
            return Err(Refusal::Elsewhere(
                "its kernels divide integers, and a division by zero there ends the process it runs in (a divide \
                 fault, or an error thrown inside a parallel region)"
                    .into(),
            ));
        }
        if let Some(check) = throws_in_parallel(&text) {
            return Err(Refusal::Elsewhere(format!(
                "a kernel checks `{check}` inside a parallel region, and a failed check there would end the server"
            )));
        }
    }
    let metadata = match found.metadata {
        Some(k) => {
            let mut text = String::new();
            let entry = zip.by_index(k).map_err(|e| broken(e.to_string()))?;
            entry.take(MAX_METADATA).read_to_string(&mut text).map_err(|e| broken(format!("its metadata: {e}")))?;
            parse_metadata(&text).map_err(broken)?
        }
        None => HashMap::new(),
    };
    // The library's first bytes before anything is written: a member that is not an ELF file is
    // refused without unpacking it (it may unpack to far more than the archive holds).
    let mut magic = [0u8; 4];
    zip.by_index(library)
        .map_err(|e| broken(e.to_string()))?
        .read_exact(&mut magic)
        .map_err(|e| broken(format!("its model library: {e}")))?;
    if &magic != b"\x7fELF" {
        return Err(Refusal::Broken(format!(
            "the model library in '{}' is not a loadable library: not an ELF file",
            path.display()
        )));
    }
    let dir = tempfile::Builder::new().prefix("ferry-aoti-").tempdir().map_err(|e| broken(e.to_string()))?;
    let target = dir.path().join("model.so");
    let digest = {
        let entry = zip.by_index(library).map_err(|e| broken(e.to_string()))?;
        let mut out =
            std::fs::File::create(&target).map_err(|e| broken(format!("cannot write {}: {e}", target.display())))?;
        let mut hashing = Hashing { out: &mut out, hash: Sha256::new() };
        let copied = std::io::copy(&mut entry.take(MAX_LIBRARY + 1), &mut hashing)
            .map_err(|e| broken(format!("its model library: {e}")))?;
        if copied > MAX_LIBRARY {
            return Err(broken(format!("its model library is over {} GiB", MAX_LIBRARY >> 30)));
        }
        let digest = hashing.hash.finalize();
        out.flush().map_err(|e| broken(e.to_string()))?;
        digest.iter().map(|b| format!("{b:02x}")).collect::<String>()
    };
    elf::patch_file(&target).map_err(|e| {
        Refusal::Broken(format!("the model library in '{}' is not a loadable library: {e}", path.display()))
    })?;
    Ok(Opened { dir, library: target, digest, least_rows, metadata })
}

/// Writes through to a file while hashing what passes.
struct Hashing<'a> {
    out: &'a mut std::fs::File,
    hash: Sha256,
}

impl Write for Hashing<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.out.write(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

/// The least size the generated input checks accept for an input's first dimension (1 when
/// they say nothing): `"dim value is too small at 0, " << "expected it to be >= N, "`.
pub fn least_first_dim(source: &str) -> i64 {
    const SAID: &str = "dim value is too small at 0, ";
    const BOUND: &str = "expected it to be >= ";
    let mut least = 1i64;
    for (at, _) in source.match_indices(SAID) {
        let after = &source[at + SAID.len()..];
        let Some(b) = after.get(..200).unwrap_or(after).find(BOUND) else { continue };
        let digits: String = after[b + BOUND.len()..].chars().take_while(char::is_ascii_digit).collect();
        if let Ok(n) = digits.parse::<i64>() {
            least = least.max(n.clamp(1, 1 << 20));
        }
    }
    least
}

/// Whether generated kernels may divide integers by a value from a tensor: Inductor's floor
/// division and modulo helpers (whose division-by-zero bookkeeping is one flag shared by every
/// package in the process, raised as an exception inside parallel regions), or a kernel with an
/// integer tensor among its parameters that writes `/` or `%` (a plain integer division by zero
/// is a hardware fault). Over-cautious (an integer kernel dividing by a constant counts): such a
/// package only runs in a process instead.
pub fn divides_integers(source: &str) -> bool {
    const HELPERS: [&str; 2] = ["floor_divide_integral(", "div_floor_integer("];
    const INTEGER: [&str; 9] =
        ["int8_t*", "int16_t*", "int32_t*", "int64_t*", "uint8_t*", "uint16_t*", "uint32_t*", "uint64_t*", "bool*"];
    // Sizes are divided by constants (`div_floor_integer(ks0, static_cast<int64_t>(2L))`): safe.
    let constant = |d: &str| {
        let d = d.trim_end_matches('L');
        !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit())
    };
    let by_variable = |helper: &str| {
        source.match_indices(helper).any(|(at, _)| !divisor(&source[at + helper.len()..]).is_some_and(constant))
    };
    if HELPERS.iter().any(|h| by_variable(h)) {
        return true;
    }
    source.split("extern \"C\"").skip(1).any(|kernel| {
        // A function (not an `extern "C" { ... }` block): its parameters, then its body's code.
        if kernel.trim_start().starts_with('{') {
            return false;
        }
        let Some((params, rest)) = kernel.split_once(')') else { return false };
        let params = params.replace(' ', "");
        let code = block(rest).lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n");
        INTEGER.iter().any(|t| params.contains(t)) && (code.contains(" / ") || code.contains(" % "))
    })
}

/// The brace block that starts at the first `{` of `text` (to its end when unclosed).
fn block(text: &str) -> &str {
    let Some(open) = text.find('{') else { return "" };
    let mut depth = 0usize;
    for (i, c) in text[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return &text[open..=open + i];
                }
            }
            _ => {}
        }
    }
    &text[open..]
}

/// The second argument of a call whose arguments start `args` (after its opening parenthesis),
/// with casts peeled: `static_cast<int64_t>(2L)` is `2L`. None when unreadable.
fn divisor(args: &str) -> Option<&str> {
    let mut depth = 0usize;
    let mut start = None;
    for (i, c) in args.char_indices().take(4096) {
        match c {
            '(' | '<' => depth += 1,
            ')' | '>' if depth > 0 => depth -= 1,
            ')' => {
                let mut d = args[start?..i].trim();
                while let Some((_, inner)) = d.strip_prefix("static_cast<").and_then(|r| r.split_once(">(")) {
                    d = inner.strip_suffix(')')?.trim();
                }
                return Some(d);
            }
            ',' if depth == 0 => start = Some(i + 1),
            _ => {}
        }
    }
    None
}

/// A check (`AOTI_TORCH_CHECK`, `TORCH_CHECK`, `throw`) inside an OpenMP parallel region of
/// generated source, if there is one.
pub fn throws_in_parallel(source: &str) -> Option<&'static str> {
    const CHECKS: [&str; 4] = ["AOTI_TORCH_CHECK", "TORCH_CHECK", "throw ", "throw("];
    let mut rest = source;
    while let Some(at) = rest.find("#pragma omp parallel") {
        let after = &rest[at..];
        // The region is the statement after the pragma: a block, to its closing brace.
        let Some(open) = after.find('{') else { break };
        let mut depth = 0usize;
        let mut end = after.len();
        for (i, c) in after[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + i;
                        break;
                    }
                }
                _ => {}
            }
        }
        let region = &after[..end];
        if let Some(check) = CHECKS.iter().find(|c| region.contains(*c)) {
            return Some(check.trim_end_matches(['(', ' ']));
        }
        rest = &after[end..];
    }
    None
}

/// The part of an entry's name within the package's model folder (`<archive>/data/aotinductor/model/`).
fn model_entry(name: &str) -> Option<&str> {
    let rest =
        name.strip_prefix(MODEL_DIR).or_else(|| name.split_once('/').and_then(|(_, r)| r.strip_prefix(MODEL_DIR)))?;
    (!rest.is_empty()).then_some(rest)
}

/// The metadata file: a JSON object of strings.
fn parse_metadata(text: &str) -> Result<HashMap<String, String>, String> {
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("its metadata is not JSON: {e}"))?;
    let object = value.as_object().ok_or("its metadata is not a JSON object")?;
    Ok(object.iter().map(|(k, v)| (k.clone(), v.as_str().map_or_else(|| v.to_string(), str::to_string))).collect())
}

/// Whether this machine's CPU runs code compiled for the package's instruction set
/// (`AOTI_CPU_ISA`) on its architecture (`AOTI_MACHINE`); the reason when not.
pub fn runs_here(metadata: &HashMap<String, String>) -> Result<(), String> {
    if let Some(machine) = metadata.get("AOTI_MACHINE").filter(|m| !m.is_empty())
        && machine != std::env::consts::ARCH
    {
        return Err(format!("it was compiled for {machine}, and this machine is {}", std::env::consts::ARCH));
    }
    let isa = metadata.get("AOTI_CPU_ISA").map(|s| s.to_ascii_lowercase()).unwrap_or_default();
    let missing = missing_features(&isa);
    if !missing.is_empty() {
        return Err(format!(
            "it was compiled for the {isa} instruction set, and this CPU lacks {} (compile the package on a machine \
             like the one serving it)",
            missing.join(", ")
        ));
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
fn missing_features(isa: &str) -> Vec<&'static str> {
    let mut missing = Vec::new();
    if isa.contains("avx2") || isa.contains("avx512") || isa.contains("amx") {
        if !std::arch::is_x86_feature_detected!("avx2") {
            missing.push("avx2");
        }
        if !std::arch::is_x86_feature_detected!("fma") {
            missing.push("fma");
        }
    }
    if isa.contains("avx512") || isa.contains("amx") {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            missing.push("avx512f");
        }
        if !std::arch::is_x86_feature_detected!("avx512bw") {
            missing.push("avx512bw");
        }
        if !std::arch::is_x86_feature_detected!("avx512vl") {
            missing.push("avx512vl");
        }
    }
    missing
}

#[cfg(not(target_arch = "x86_64"))]
fn missing_features(_isa: &str) -> Vec<&'static str> {
    Vec::new()
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::{
        super::elf::tests::{elf, needed_names},
        *,
    };

    const KERNEL: &[u8] = b"extern \"C\" void k(float* x) {\n  #pragma omp parallel\n  { x[0] = 1; }\n}\n";

    #[test]
    fn the_least_first_dimension_is_read_from_the_input_checks() {
        let check = r#"    if (arg0_1_size[0] < 2) {
        std::stringstream ss;
        ss << "input_handles[0]: dim value is too small at 0, "
           << "expected it to be >= 2, " << "but got: "
           << arg0_1_size[0] << "\n";
    }
    if (arg0_1_size[1] < 4) {
        ss << "input_handles[0]: dim value is too small at 1, "
           << "expected it to be >= 4, " << "but got: ""#;
        assert_eq!(least_first_dim(check), 2);
        assert_eq!(least_first_dim("no checks"), 1);
        assert_eq!(least_first_dim("dim value is too small at 0, expected it to be >= 99999999999999999999"), 1);
    }

    #[test]
    fn integer_division_is_found() {
        let trunc = "extern \"C\"  void  cpp_fused_div_0(const int64_t* in_ptr0,\n const int64_t* in_ptr1,\n int64_t* out_ptr0)\n{\n auto tmp2 = tmp0 / tmp1;\n}";
        assert!(divides_integers(trunc));
        assert!(divides_integers("extern \"C\" void k(float* out_ptr0) { x = floor_divide_integral(a, b); }"));
        let modulo = "extern \"C\" void k(const int32_t * in_ptr0, float* out_ptr0) { auto r = a % b; }";
        assert!(divides_integers(modulo));
        // Comments and `extern "C"` blocks are not kernels; what follows a kernel is not its body.
        let wrapper = "extern \"C\" {\n int f(int64_t* x);\n}\n// Create / CreateV2\nextern \"C\" void k(const int64_t* in_ptr0) {\n  // a / b\n  out = in_ptr0[0];\n}\nint g() { return a / b; }";
        assert!(!divides_integers(wrapper));
        // Sizes divided by constants are not data divided by data.
        let sizes = "extern \"C\" void k(const float* in_ptr0, const int64_t ks0) { x < static_cast<int64_t>(8L*(c10::div_floor_integer(static_cast<int64_t>(ks0), static_cast<int64_t>(2L)))); }";
        assert!(!divides_integers(sizes));
        assert!(divides_integers(
            "void k() { c10::div_floor_integer(static_cast<int64_t>(a), static_cast<int64_t>(tmp1)); }"
        ));
        assert_eq!(divisor("a, static_cast<int64_t>(2L)) + 1"), Some("2L"));
        assert_eq!(divisor("f(a, b), c)"), Some("c"));
        assert_eq!(divisor("a)"), None);
        // Float kernels (sizes as plain integers), and integer kernels that do not divide.
        let float = "extern \"C\" void k(float* in_out_ptr0, const int64_t ks0) { std::atomic<int> inductor_cpu_integer_div_error{0}; y = x / 2.0f; }";
        assert!(!divides_integers(float));
        assert!(!divides_integers(
            "extern \"C\" void k(const int64_t* in_ptr0, float* out_ptr0) { out = table[idx]; }"
        ));
    }

    #[test]
    fn checks_inside_parallel_regions_are_found() {
        let inside = "void k() {\n  #pragma omp parallel\n  {\n    #pragma omp for\n    for (int i = 0; i < n; i++) {\n      AOTI_TORCH_CHECK(i < 10, \"index out of bounds\");\n    }\n  }\n}";
        assert_eq!(throws_in_parallel(inside), Some("AOTI_TORCH_CHECK"));
        let outside = "void k() {\n  #pragma omp parallel\n  { x = 1; }\n  AOTI_TORCH_CHECK(x < 10, \"ok\");\n  inductor_cpu_throw_if_integer_div_error(e);\n}";
        assert_eq!(throws_in_parallel(outside), None);
        assert_eq!(throws_in_parallel("void k() { AOTI_TORCH_CHECK(a, \"serial\"); }"), None);
        let second =
            "#pragma omp parallel\n{ a(); }\n#pragma omp parallel\n{ if (b) throw std::runtime_error(\"x\"); }";
        assert_eq!(throws_in_parallel(second), Some("throw"));
        // An unclosed region is read to the end.
        assert_eq!(throws_in_parallel("#pragma omp parallel\n{ { TORCH_CHECK(a); "), Some("TORCH_CHECK"));
    }

    fn package(entries: &[(&str, &[u8])]) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        {
            let mut zip = zip::ZipWriter::new(f.as_file_mut());
            for (name, data) in entries {
                zip.start_file(
                    *name,
                    zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored),
                )
                .unwrap();
                zip.write_all(data).unwrap();
            }
            zip.finish().unwrap();
        }
        f
    }

    #[test]
    fn the_model_library_is_taken_out_under_a_fixed_name() {
        let so = elf(&["libtorch.so", "libtorch_cpu.so"]);
        let f = package(&[
            ("m/data/aotinductor/model/abc.wrapper.so", &so),
            ("m/data/aotinductor/model/k.kernel.cpp", KERNEL),
            (
                "m/data/aotinductor/model/abc.wrapper_metadata.json",
                br#"{"AOTI_DEVICE_KEY": "cpu", "AOTI_CPU_ISA": "AVX2"}"#,
            ),
            ("m/archive_format", b"pt2"),
        ]);
        let opened = open(f.path()).unwrap();
        assert_eq!(opened.library, opened.dir.path().join("model.so"));
        assert_eq!(opened.metadata["AOTI_DEVICE_KEY"], "cpu");
        let mut written = std::fs::read(&opened.library).unwrap();
        assert_eq!(needed_names(&mut written), ["libtorch_cpu.so", "libtorch_cpu.so"]);
    }

    #[test]
    fn forms_the_server_does_not_run_go_to_a_process() {
        let so = elf(&["libtorch_cpu.so"]);
        let cpp_only = package(&[("m/data/aotinductor/model/abc.wrapper.cpp", b"int x;")]);
        assert!(matches!(open(cpp_only.path()), Err(Refusal::Elsewhere(_))));
        let weights_apart = package(&[("m/data/aotinductor/model/a.so", &so), ("m/data/weights/w0", b"0000")]);
        assert!(matches!(open(weights_apart.path()), Err(Refusal::Elsewhere(_))));
        let two = package(&[("m/data/aotinductor/model/a.so", &so), ("m/data/aotinductor/model/b.so", &so)]);
        assert!(matches!(open(two.path()), Err(Refusal::Elsewhere(_))));
        let no_sources = package(&[("m/data/aotinductor/model/a.so", &so)]);
        assert!(matches!(open(no_sources.path()), Err(Refusal::Elsewhere(e)) if e.contains("no kernel sources")));
        let divides = b"extern \"C\" void k(const int64_t* in_ptr0, int64_t* out_ptr0) { auto t = a / b; }";
        let dividing =
            package(&[("m/data/aotinductor/model/a.so", &so), ("m/data/aotinductor/model/a.kernel.cpp", divides)]);
        assert!(matches!(open(dividing.path()), Err(Refusal::Elsewhere(e)) if e.contains("divide integers")));
        let checked = b"#pragma omp parallel\n{ AOTI_TORCH_CHECK(i < 9, \"index out of bounds\"); }";
        let parallel =
            package(&[("m/data/aotinductor/model/a.so", &so), ("m/data/aotinductor/model/a.kernel.cpp", checked)]);
        assert!(matches!(open(parallel.path()), Err(Refusal::Elsewhere(e)) if e.contains("inside a parallel region")));
    }

    #[test]
    fn broken_packages_say_so() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(b"PK\x03\x04 not really").unwrap();
        assert!(matches!(open(f.path()), Err(Refusal::Broken(e)) if e.contains("is not an AOTInductor package")));
        let not_elf = package(&[
            ("m/data/aotinductor/model/a.so", b"\x7fELF garbage"),
            ("m/data/aotinductor/model/k.cpp", KERNEL),
        ]);
        assert!(matches!(open(not_elf.path()), Err(Refusal::Broken(e)) if e.contains("not a loadable library")));
        // A member that is not ELF is refused from its first bytes, before it is unpacked.
        let zeros = vec![0u8; 1 << 20];
        let not_elf_at_all =
            package(&[("m/data/aotinductor/model/a.so", &zeros), ("m/data/aotinductor/model/k.cpp", KERNEL)]);
        assert!(matches!(open(not_elf_at_all.path()), Err(Refusal::Broken(e)) if e.ends_with("not an ELF file")));
        let bad_meta = package(&[
            ("m/data/aotinductor/model/a.so", &elf(&[])),
            ("m/data/aotinductor/model/k.cpp", KERNEL),
            ("m/data/aotinductor/model/a_metadata.json", b"[1,2]"),
        ]);
        assert!(matches!(open(bad_meta.path()), Err(Refusal::Broken(e)) if e.contains("metadata")));
        // Names that climb out of the archive are never used as paths.
        let climbing = package(&[("../../etc/data/aotinductor/model/x/../../a.so", &elf(&[]))]);
        assert!(matches!(open(climbing.path()), Err(Refusal::Elsewhere(_))));
    }

    #[test]
    fn packages_for_another_machine_are_refused_with_the_reason() {
        let meta = |k: &str, v: &str| HashMap::from([(k.to_string(), v.to_string())]);
        assert!(runs_here(&meta("AOTI_MACHINE", "aarch64")).unwrap_err().contains("compiled for aarch64"));
        assert!(runs_here(&meta("AOTI_CPU_ISA", "")).is_ok());
        assert!(runs_here(&HashMap::new()).is_ok());
    }
}
