//! One Python process and its channel: started with the stub, connected over a Unix socket,
//! messages framed as length-prefixed JSON followed by binary blobs (the stub's `Channel`); its
//! stdout and stderr lines go to ferry's log under the model's name.
use std::{
    collections::VecDeque,
    io::{BufRead, BufReader, Read, Write},
    os::unix::{
        net::{UnixListener, UnixStream},
        process::CommandExt,
    },
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::error::{Error, Result};

/// Most bytes one message may carry (a framing error must not allocate without bound); its
/// JSON part is smaller still. Bytes are allocated as they arrive, not as announced.
pub(super) const MAX_MESSAGE: u64 = 4 << 30;
const MAX_JSON: u64 = 64 << 20;
/// Longest line of a process's output forwarded as one log line (longer ones are split).
const MAX_LINE: usize = 16 << 10;

/// A message: its JSON part and its blobs.
pub type Message = (Value, Vec<Vec<u8>>);

/// The writing half, shared by the instance thread and BLS replies.
#[derive(Clone)]
pub struct Writer(Arc<Mutex<UnixStream>>);

impl Writer {
    pub fn send<T: serde::Serialize + ?Sized>(&self, msg: &T, blobs: &[&[u8]]) -> std::io::Result<()> {
        let body = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
        let mut out = Vec::with_capacity(8 + body.len());
        out.extend((body.len() as u32).to_le_bytes());
        out.extend(&body);
        out.extend((blobs.len() as u32).to_le_bytes());
        let mut s = self.0.lock().unwrap_or_else(|p| p.into_inner());
        s.write_all(&out)?;
        for b in blobs {
            s.write_all(&(b.len() as u64).to_le_bytes())?;
            s.write_all(b)?;
        }
        s.flush()
    }
}

pub struct Process {
    child: Child,
    reader: UnixStream,
    pub writer: Writer,
    /// The last lines it wrote to stderr, for errors that say why it died.
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    /// What its shared-memory regions (and ferry's for it) are named after.
    pub prefix: String,
    /// Ends the threads that forward its output (a helper it started may hold the pipes open).
    forwarding: Arc<std::sync::atomic::AtomicBool>,
}

/// `n` bytes, read into a buffer that grows as they arrive (a peer announcing gigabytes and
/// sending nothing costs nothing).
fn read_exact(r: &mut impl Read, n: usize) -> std::io::Result<Vec<u8>> {
    let mut buf = Vec::with_capacity(n.min(1 << 20));
    r.take(n as u64).read_to_end(&mut buf)?;
    if buf.len() != n {
        return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the message ended early"));
    }
    Ok(buf)
}

/// One message: length-prefixed JSON, then its blobs.
pub fn read_message(r: &mut impl Read) -> std::io::Result<Message> {
    let n = u32::from_le_bytes(read_exact(r, 4)?.try_into().unwrap_or_default()) as u64;
    if n > MAX_JSON {
        return Err(std::io::Error::other(format!("a message of {n} bytes")));
    }
    let msg: Value = serde_json::from_slice(&read_exact(r, n as usize)?).map_err(std::io::Error::other)?;
    let count = u32::from_le_bytes(read_exact(r, 4)?.try_into().unwrap_or_default());
    let mut blobs = Vec::with_capacity(count.min(1024) as usize);
    let mut total = n;
    for _ in 0..count {
        let len = u64::from_le_bytes(read_exact(r, 8)?.try_into().unwrap_or_default());
        total = total.saturating_add(len);
        if total > MAX_MESSAGE {
            return Err(std::io::Error::other(format!("a message of more than {MAX_MESSAGE} bytes")));
        }
        blobs.push(read_exact(r, len as usize)?);
    }
    Ok((msg, blobs))
}

/// Whether `fd` has something to read (data, its end, an error), waiting for it; false once
/// `stop` is set while nothing comes.
fn readable(fd: std::os::fd::RawFd, stop: &std::sync::atomic::AtomicBool) -> bool {
    loop {
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: poll(2) on one pollfd we own, for at most half a second.
        let n = unsafe { libc::poll(&mut p, 1, 500) };
        if n != 0 && !(n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted) {
            return true;
        }
        if stop.load(std::sync::atomic::Ordering::Acquire) {
            return false;
        }
    }
}

/// Forwards what a process writes, line by line, to ferry's log: bytes, not text (a byte that is
/// not UTF-8 is shown replaced, and never stops the forwarding, which would make the process's
/// next write fail), lines cut at [`MAX_LINE`]. Ends at the pipe's end, or once `stop` is set
/// and nothing more comes.
fn forward_lines(
    stream: impl Read + std::os::fd::AsRawFd + Send + 'static,
    model: String,
    tail: Option<Arc<Mutex<VecDeque<String>>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) {
    std::thread::spawn(move || {
        let fd = stream.as_raw_fd();
        let mut r = BufReader::new(stream);
        let mut line = Vec::new();
        let emit = |line: &[u8]| {
            let text = String::from_utf8_lossy(line);
            tracing::info!(model = %model, "python: {text}");
            if let Some(tail) = &tail {
                let mut t = tail.lock().unwrap_or_else(|p| p.into_inner());
                if t.len() == 20 {
                    t.pop_front();
                }
                t.push_back(text.into_owned());
            }
        };
        loop {
            if r.buffer().is_empty() && !readable(fd, &stop) {
                break;
            }
            let buf = match r.fill_buf() {
                Ok([]) => break,
                Ok(b) => b,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            };
            let room = MAX_LINE - line.len();
            let (take, ends) = match buf.iter().take(room).position(|&b| b == b'\n') {
                Some(i) => (i + 1, true),
                None => (buf.len().min(room), line.len() + buf.len().min(room) == MAX_LINE),
            };
            line.extend_from_slice(&buf[..take]);
            r.consume(take);
            if ends {
                let end = line.len() - usize::from(line.last() == Some(&b'\n'));
                emit(&line[..end]);
                line.clear();
            }
        }
        if !line.is_empty() {
            emit(&line);
        }
    });
}

impl Process {
    /// Starts `python stub.py <socket>` and waits (up to `timeout`) for it to connect.
    pub fn start(python: &Path, stub_dir: &Path, model: &str, workdir: &Path, timeout: Duration) -> Result<Process> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let socket: PathBuf = stub_dir.join(format!("s-{n}.sock"));
        let _ = std::fs::remove_file(&socket);
        let listener =
            UnixListener::bind(&socket).map_err(|e| Error::internal(format!("cannot create a socket: {e}")))?;
        listener.set_nonblocking(true).map_err(|e| Error::internal(e.to_string()))?;
        let python_path = match std::env::var_os("PYTHONPATH") {
            Some(p) if !p.is_empty() => {
                let mut v = stub_dir.as_os_str().to_os_string();
                v.push(":");
                v.push(p);
                v
            }
            _ => stub_dir.as_os_str().to_os_string(),
        };
        let prefix = super::live::prefix();
        let spawning = super::live::spawning();
        let mut child = Command::new(python)
            .arg("-u")
            .arg(stub_dir.join("ferry_stub.py"))
            .arg(&socket)
            .arg(&prefix)
            // Its own process group: what it forks is killed with it.
            .process_group(0)
            .env("PYTHONPATH", python_path)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .current_dir(workdir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| Error::unavailable(format!("cannot start '{}' for model '{model}': {e}", python.display())))?;
        super::live::started(child.id(), &prefix);
        drop(spawning);
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let forwarding = Arc::new(std::sync::atomic::AtomicBool::new(false));
        if let Some(out) = child.stdout.take() {
            forward_lines(out, model.to_string(), None, Arc::clone(&forwarding));
        }
        if let Some(err) = child.stderr.take() {
            forward_lines(err, model.to_string(), Some(Arc::clone(&tail)), Arc::clone(&forwarding));
        }
        // Until it connects, a failure kills and reaps it (no zombie, no orphaned helper).
        let abandon = |child: &mut Child| {
            super::live::release(child.id(), &prefix);
            let _ = child.kill();
            let _ = child.wait();
            super::live::forget(child.id());
            forwarding.store(true, std::sync::atomic::Ordering::Release);
        };
        let started = Instant::now();
        let stream = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => {
                    abandon(&mut child);
                    return Err(Error::internal(format!("python process for model '{model}': {e}")));
                }
            }
            if super::live::exited(child.id()) {
                super::live::release(child.id(), &prefix);
                let status = child.wait().map_or("an unknown status".into(), |s| s.to_string());
                super::live::forget(child.id());
                forwarding.store(true, std::sync::atomic::Ordering::Release);
                std::thread::sleep(Duration::from_millis(50));
                let why = tail.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned().collect::<Vec<_>>().join("\n");
                return Err(Error::unavailable(format!(
                    "the Python process for model '{model}' ({}) exited with {status} before connecting: {why}",
                    python.display()
                )));
            }
            if started.elapsed() > timeout {
                abandon(&mut child);
                return Err(Error::unavailable(format!(
                    "the Python process for model '{model}' did not start within {} s",
                    timeout.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let _ = std::fs::remove_file(&socket);
        let process = |stream: UnixStream| -> std::io::Result<Process> {
            stream.set_nonblocking(false)?;
            let writer = Writer(Arc::new(Mutex::new(stream.try_clone()?)));
            Ok(Process { child, reader: stream, writer, stderr_tail: tail, prefix, forwarding })
        };
        process(stream).map_err(|e| Error::internal(e.to_string()))
    }

    /// Whether the process itself has ended (its socket may live on in a helper it forked).
    /// It is not reaped here (WNOWAIT): until `death` or drop, its pid stays its own.
    pub fn exited(&self) -> bool {
        super::live::exited(self.child.id())
    }

    pub fn set_timeout(&self, t: Option<Duration>) {
        let _ = self.reader.set_read_timeout(t);
    }

    /// The next message from the process (before a reader thread takes the channel over).
    pub fn recv(&mut self) -> std::io::Result<Message> {
        read_message(&mut self.reader)
    }

    /// The reading half, for a thread that reads everything the process sends from now on.
    pub fn reader(&self) -> std::io::Result<UnixStream> {
        let r = self.reader.try_clone()?;
        r.set_read_timeout(None)?;
        Ok(r)
    }

    /// Why the process is gone, once it is: its exit status, and its last stderr lines (for
    /// the log only: they may hold paths or secrets).
    pub fn death(&mut self) -> (String, String) {
        // What it started goes first, while its pid is still its own (it is not reaped yet).
        super::live::release(self.child.id(), &self.prefix);
        let status = self.child.wait().map_or("killed".into(), |s| s.to_string());
        super::live::forget(self.child.id());
        let tail = self.stderr_tail.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned().collect::<Vec<_>>();
        (status, tail.join(" | "))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Process {
    /// Its group killed, its regions removed, the process reaped, and the socket shut so that
    /// the reader thread ends even while a helper it forked still holds the other end.
    fn drop(&mut self) {
        super::live::release(self.child.id(), &self.prefix);
        let _ = self.child.kill();
        let _ = self.child.wait();
        super::live::forget(self.child.id());
        let _ = self.reader.shutdown(std::net::Shutdown::Both);
        self.forwarding.store(true, std::sync::atomic::Ordering::Release);
    }
}
