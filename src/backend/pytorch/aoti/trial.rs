//! A package's first run, in a process of its own (`ferry __aoti-trial`), before its library is
//! loaded into the server: the load-time batch check (`probe::check_batch`), or one run of sample
//! inputs, where a package compiled for instructions this CPU lacks (the compiler's
//! `-march=native` goes past what the package's metadata says) or otherwise broken would end the
//! server. The trial's failure is the load's, with the reason.
use std::{
    ffi::OsString,
    io::{Read, Write},
    path::{Path, PathBuf},
    process::{Command, ExitCode, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use super::{super::params::Params, AotiInstance, Library, Loaded, ffi, probe};
use crate::{
    backend::{BackendInput, ModelInstance},
    proto::{inference::ModelConfig, pbtxt},
    tensor::{DataType, element_count},
};

/// The hidden command the trial process runs.
pub const COMMAND: &str = "__aoti-trial";
/// How long a trial may take (a large model's weights load, then two runs).
const TIMEOUT: Duration = Duration::from_secs(300);
/// What starts the trial's own verdict on its standard output (the package may print there too).
const VERDICT: &str = "ferry-trial: ";

/// Runs the trial of `library` (a package's copied-out model library) under `config`.
pub fn run(library: &Path, least_rows: i64, torch: &Path, config: &ModelConfig) -> Result<(), String> {
    // This very binary, even when the file was replaced since it started.
    let mut command = Command::new("/proc/self/exe");
    // SAFETY: prctl is async-signal-safe; the trial ends with the server (a stop during a load
    // leaves no trial behind).
    unsafe {
        use std::os::unix::process::CommandExt;
        command.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let mut child = command
        .arg(COMMAND)
        .arg(library)
        .arg(least_rows.to_string())
        .arg(torch)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start a trial run: {e}"))?;
    let json = pbtxt::to_json(config).to_string();
    if let Some(mut stdin) = child.stdin.take() {
        // A trial that dies before reading says why below.
        let _ = stdin.write_all(json.as_bytes());
    }
    let read = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = Vec::new();
            if let Some(p) = pipe {
                let _ = p.take(1 << 20).read_to_end(&mut text);
            }
            String::from_utf8_lossy(&text).into_owned()
        })
    };
    let out = read(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let err = read(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() > TIMEOUT => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("a trial run of the package did not end within {} s", TIMEOUT.as_secs()));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("cannot wait for a trial run: {e}")),
        }
    };
    let (out, err) = (out.join().unwrap_or_default(), err.join().unwrap_or_default());
    if status.success() {
        return Ok(());
    }
    use std::os::unix::process::ExitStatusExt;
    if let Some(signal) = status.signal() {
        let (name, hint) = match signal {
            libc::SIGILL => ("SIGILL", ": it uses instructions this CPU lacks; compile it on a machine like this one"),
            libc::SIGSEGV => ("SIGSEGV", ""),
            libc::SIGBUS => ("SIGBUS", ""),
            libc::SIGABRT => ("SIGABRT", ""),
            libc::SIGFPE => ("SIGFPE", ": an arithmetic fault, such as an integer division by zero"),
            _ => ("a signal", ""),
        };
        let said = last_lines(&err);
        return Err(format!(
            "the package ended a trial run in a process of its own with {name} ({signal}){hint}{}",
            if said.is_empty() { String::new() } else { format!(" (it wrote: {said})") }
        ));
    }
    // The trial's verdict, not what the package printed.
    match out.lines().rev().find_map(|l| l.strip_prefix(VERDICT)) {
        Some(said) => Err(clip(said)),
        None => Err(format!("a trial run of the package failed ({status}): {}", last_lines(&err))),
    }
}

fn clip(text: &str) -> String {
    let end = text.char_indices().nth(2000).map_or(text.len(), |(i, _)| i);
    text[..end].to_string()
}

/// The end of what a process wrote, on one line.
fn last_lines(text: &str) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = lines[lines.len().saturating_sub(3)..].join(" | ");
    let start = tail.char_indices().rev().nth(1000).map_or(0, |(i, _)| i);
    tail[start..].to_string()
}

/// The trial process: `ferry __aoti-trial <library> <least rows> <libtorch_cpu.so>`, the config's JSON on
/// standard input. Exits 0 when the package ran; 1, with the reason on the last line of standard
/// output that starts with `ferry-trial: `, when not.
pub fn child(args: &[OsString]) -> ExitCode {
    match trial(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            println!("\n{VERDICT}{}", e.replace('\n', " "));
            ExitCode::FAILURE
        }
    }
}

fn trial(args: &[OsString]) -> Result<(), String> {
    let [library, least_rows, torch] = args else {
        return Err(format!("usage: ferry {COMMAND} <library> <least rows> <libtorch_cpu.so>"));
    };
    let least_rows: i64 = least_rows.to_string_lossy().parse().map_err(|_| "the least rows is not a number")?;
    let mut json = String::new();
    std::io::stdin().take(64 << 20).read_to_string(&mut json).map_err(|e| e.to_string())?;
    let config = pbtxt::from_json(&json)?;
    let params = Params::of(&config, false)?;
    let torch = Arc::new(super::super::ctensor::Torch::load(Path::new(torch))?);
    let path = PathBuf::from(library);
    let model = Arc::new(ffi::ModelLibrary::load(&path)?);
    let container = ffi::Container::new(Arc::clone(&model), 1, &path)?;
    let library = Arc::new(Library { model, path, least_rows, digest: String::new(), _dir: None });
    let loaded = Arc::new(Loaded { container, library });
    let instance = AotiInstance::new(torch, loaded, &config, params.threads.unwrap_or(1))?;
    if config.max_batch_size > 0 {
        return probe::check_batch(&instance, &config);
    }
    // Not batching: one run of sample inputs where every dimension is fixed; its answer is not
    // checked (only that the process lives through it).
    let mut inputs = Vec::new();
    for i in &config.input {
        let (Some(datatype), Some(n)) = (DataType::from_config(i.data_type), element_count(&i.dims)) else {
            return Ok(());
        };
        if n > 1 << 24 {
            return Ok(());
        }
        inputs.push((i.name.as_str(), datatype, i.dims.clone(), probe::sample(datatype, n)));
    }
    let given: Vec<BackendInput<'_>> = inputs
        .iter()
        .map(|(name, datatype, shape, data)| BackendInput { name, datatype: *datatype, shape, data, device: &[] })
        .collect();
    let outputs: Vec<&str> = config.output.iter().map(|o| o.name.as_str()).collect();
    let mut instance = instance;
    let _ = instance.execute(&given, &outputs);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_end_of_what_a_process_wrote_is_kept() {
        assert_eq!(last_lines("a\n\nb\nc\nd\n"), "b | c | d");
        assert_eq!(last_lines(""), "");
        assert!(last_lines(&"x".repeat(5000)).len() <= 1001);
    }
}
