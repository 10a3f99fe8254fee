//! Disk I/O off the model thread.
//!
//! One I/O thread runs [`DiskJob`]s in order and reports each as a [`DiskDone`]. Block
//! transfers go straight between files and host-arena extents with `O_DIRECT` (where the
//! filesystem allows it), through io_uring with the arena registered as fixed buffers (where
//! the kernel and memory-lock limit allow), all of a job's blocks in flight at once. Without
//! io_uring the thread falls back to `pread`/`pwrite`: slower, same results.
//!
//! Extents are owned by the scheduler while a job runs (the host entry is pinned), so the
//! thread reads and writes their bytes without locks.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::arena::{HostArena, HostExtent};
use crate::disk::{BlockRead, DiskIdentity, WritePlan, checksum};

/// Largest fixed buffer registered with io_uring (the kernel's per-buffer limit).
const FIXED_CHUNK: u64 = 1 << 30;
/// Submission queue entries: a job's blocks beyond this go in waves.
const RING_ENTRIES: u32 = 64;

/// Work for the I/O thread.
#[derive(Debug)]
pub enum DiskJob {
    /// Writes `plan`'s file from `extents` (one per stored block, in order): blocks, then the
    /// header with their checksums, sync, then the rename that makes it visible.
    Write { token: u64, plan: Box<WritePlan>, extents: Vec<HostExtent>, identity: DiskIdentity },
    /// Reads blocks into extents and verifies their checksums.
    Read { token: u64, reads: Vec<(BlockRead, HostExtent)> },
    /// Unlinks a file (errors ignored: it may already be gone).
    Delete(PathBuf),
}

/// A job's outcome.
#[derive(Debug)]
pub enum DiskDone {
    /// The checksums of the blocks written, in order.
    Written {
        token: u64,
        result: Result<Vec<u64>, IoFailure>,
    },
    Read {
        token: u64,
        result: Result<(), IoFailure>,
    },
}

/// Why a job failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IoFailure {
    #[error("{op} {path}: {error}")]
    Io { op: &'static str, path: PathBuf, error: String },
    #[error("{path} at {offset}: {got} of {want} bytes")]
    Short { path: PathBuf, offset: u64, got: u64, want: u64 },
    #[error("{path} at {offset}: checksum mismatch")]
    Checksum { path: PathBuf, offset: u64 },
    #[error("the disk I/O thread is gone")]
    ThreadGone,
}

impl IoFailure {
    /// The file the failure happened in, when one is known.
    pub fn path(&self) -> Option<&Path> {
        match self {
            IoFailure::Io { path, .. } | IoFailure::Short { path, .. } | IoFailure::Checksum { path, .. } => Some(path),
            IoFailure::ThreadGone => None,
        }
    }
}

/// Faults to inject (tests): each applies to every later job until cleared.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IoFaults {
    /// Writes fail with this errno (e.g. `libc::ENOSPC`) after their blocks were written.
    pub write_errno: Option<i32>,
    /// Reads fail with this errno (e.g. `libc::EIO`).
    pub read_errno: Option<i32>,
    /// Reads come back one byte short.
    pub short_reads: bool,
    /// One byte of every read block is flipped after it lands (a corrupted medium).
    pub flip_bits: bool,
}

/// Handle to the I/O thread.
#[derive(Debug)]
pub struct DiskIo {
    jobs: Option<Sender<DiskJob>>,
    done: Receiver<DiskDone>,
    thread: Option<std::thread::JoinHandle<()>>,
    in_flight: usize,
    faults: Arc<Mutex<IoFaults>>,
    backend: &'static str,
    /// Outcomes of jobs the thread could not take (it is gone): failures, reported by `poll`.
    refused: Vec<DiskDone>,
}

impl DiskIo {
    /// Starts the I/O thread over `arena`.
    pub fn start(arena: Arc<HostArena>) -> std::io::Result<Self> {
        let (jobs, job_rx) = channel::<DiskJob>();
        let (done_tx, done) = channel::<DiskDone>();
        let faults = Arc::new(Mutex::new(IoFaults::default()));
        let (ready_tx, ready_rx) = channel::<&'static str>();
        let thread_faults = faults.clone();
        let thread = std::thread::Builder::new().name("helios-disk".into()).spawn(move || {
            let mut engine = Engine::new(arena);
            let _ = ready_tx.send(engine.backend());
            while let Ok(job) = job_rx.recv() {
                let faults = thread_faults.lock().map(|f| *f).unwrap_or_default();
                let out = match job {
                    DiskJob::Write { token, plan, extents, identity } => {
                        DiskDone::Written { token, result: engine.write(&plan, &extents, &identity, faults) }
                    }
                    DiskJob::Read { token, reads } => DiskDone::Read { token, result: engine.read(&reads, faults) },
                    DiskJob::Delete(path) => {
                        let _ = std::fs::remove_file(path);
                        continue;
                    }
                };
                if done_tx.send(out).is_err() {
                    return;
                }
            }
        })?;
        let backend = ready_rx.recv().unwrap_or("pread");
        Ok(DiskIo { jobs: Some(jobs), done, thread: Some(thread), in_flight: 0, faults, backend, refused: Vec::new() })
    }

    /// "io_uring" or "pread": how the thread moves bytes.
    pub fn backend(&self) -> &'static str {
        self.backend
    }

    /// Sets the faults injected into later jobs (tests).
    pub fn inject(&self, faults: IoFaults) {
        if let Ok(mut f) = self.faults.lock() {
            *f = faults;
        }
    }

    /// Queues a job (never blocks). A job the thread cannot take (it is gone) is reported as
    /// failed by the next `poll`, so its owner releases what it holds.
    pub fn submit(&mut self, job: DiskJob) {
        if let DiskJob::Delete(path) = job {
            if let Some(tx) = &self.jobs {
                let _ = tx.send(DiskJob::Delete(path));
            }
            return;
        }
        let job = match &self.jobs {
            Some(tx) => match tx.send(job) {
                Ok(()) => {
                    self.in_flight += 1;
                    return;
                }
                Err(std::sync::mpsc::SendError(job)) => job,
            },
            None => job,
        };
        match job {
            DiskJob::Write { token, .. } => {
                self.refused.push(DiskDone::Written { token, result: Err(IoFailure::ThreadGone) })
            }
            DiskJob::Read { token, .. } => {
                self.refused.push(DiskDone::Read { token, result: Err(IoFailure::ThreadGone) })
            }
            DiskJob::Delete(_) => {}
        }
    }

    /// Jobs submitted and not yet reported.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Outcomes ready now.
    pub fn poll(&mut self) -> Vec<DiskDone> {
        let mut out: Vec<DiskDone> = self.done.try_iter().collect();
        self.in_flight -= out.len();
        out.append(&mut self.refused);
        out
    }

    /// Waits up to `timeout` for at least one outcome; returns every outcome ready.
    pub fn wait(&mut self, timeout: Duration) -> Vec<DiskDone> {
        if !self.refused.is_empty() {
            return self.poll();
        }
        let mut out = match self.done.recv_timeout(timeout) {
            Ok(d) => vec![d],
            Err(RecvTimeoutError::Timeout) => Vec::new(),
            Err(RecvTimeoutError::Disconnected) => {
                // The thread is gone with jobs outstanding: nothing will report them.
                self.in_flight = 0;
                return Vec::new();
            }
        };
        out.extend(self.done.try_iter());
        self.in_flight -= out.len();
        out
    }
}

impl Drop for DiskIo {
    fn drop(&mut self) {
        // Closing the queue ends the thread after the jobs already queued.
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One block transfer.
#[derive(Clone, Copy, Debug)]
struct Op {
    offset: u64,
    extent: HostExtent,
}

struct Engine {
    arena: Arc<HostArena>,
    ring: Option<io_uring::IoUring>,
    fixed: bool,
}

fn errno_text(e: &std::io::Error) -> String {
    e.to_string()
}

fn open(path: &Path, write: bool) -> std::io::Result<OwnedFd> {
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    let base = if write { libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC } else { libc::O_RDONLY } | libc::O_CLOEXEC;
    for flags in [base | libc::O_DIRECT, base] {
        // SAFETY: a valid NUL-terminated path; the returned descriptor is owned below.
        let fd = unsafe { libc::open(c.as_ptr(), flags, 0o644) };
        if fd >= 0 {
            // SAFETY: a descriptor we just opened and nobody else owns.
            return Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });
        }
        let e = std::io::Error::last_os_error();
        // Filesystems without O_DIRECT (tmpfs) refuse it: buffered I/O instead.
        if e.raw_os_error() != Some(libc::EINVAL) {
            return Err(e);
        }
    }
    Err(std::io::Error::from_raw_os_error(libc::EINVAL))
}

impl Engine {
    fn new(arena: Arc<HostArena>) -> Self {
        let ring = io_uring::IoUring::new(RING_ENTRIES).ok();
        let mut fixed = false;
        if let Some(r) = &ring {
            let chunks: Vec<libc::iovec> = (0..arena.len().div_ceil(FIXED_CHUNK))
                .map(|i| libc::iovec {
                    // SAFETY: in bounds of the arena.
                    iov_base: unsafe { arena.as_ptr().add((i * FIXED_CHUNK) as usize) }.cast(),
                    iov_len: (arena.len() - i * FIXED_CHUNK).min(FIXED_CHUNK) as usize,
                })
                .collect();
            // SAFETY: the buffers stay mapped for the ring's life (the engine holds the arena).
            // Refused under a low memory-lock limit: plain (non-fixed) operations then.
            fixed = chunks.len() <= usize::from(u16::MAX) && unsafe { r.submitter().register_buffers(&chunks) }.is_ok();
        }
        Engine { arena, ring, fixed }
    }

    fn backend(&self) -> &'static str {
        match (&self.ring, self.fixed) {
            (Some(_), true) => "io_uring (fixed buffers)",
            (Some(_), false) => "io_uring",
            (None, _) => "pread",
        }
    }

    /// Moves every op's span between `fd` and the arena; returns the first failure.
    fn transfer(&mut self, fd: &OwnedFd, ops: &[Op], write: bool, path: &Path) -> Result<(), IoFailure> {
        let op_name = if write { "write" } else { "read" };
        // Remaining (offset into the span, op) per op; spans are whole units.
        let mut done: Vec<u64> = vec![0; ops.len()];
        let want = |o: &Op| o.extent.span();
        let base = self.arena.as_ptr();
        let ptr = |o: &Op, at: u64| {
            // SAFETY: the span lies in the arena (extents are allocated by span).
            unsafe { base.add((o.extent.offset + at) as usize) }
        };
        let Some(ring) = self.ring.as_mut() else {
            for (i, o) in ops.iter().enumerate() {
                while done[i] < want(o) {
                    let (p, n, off) = (ptr(o, done[i]), (want(o) - done[i]) as usize, (o.offset + done[i]) as i64);
                    // SAFETY: `p..p+n` lies in the arena, owned by this job; `fd` is open.
                    let r = unsafe {
                        if write {
                            libc::pwrite(fd.as_raw_fd(), p.cast(), n, off)
                        } else {
                            libc::pread(fd.as_raw_fd(), p.cast(), n, off)
                        }
                    };
                    let r = if r < 0 {
                        let e = std::io::Error::last_os_error();
                        if e.kind() == std::io::ErrorKind::Interrupted {
                            continue;
                        }
                        -i64::from(e.raw_os_error().unwrap_or(libc::EIO))
                    } else {
                        r as i64
                    };
                    done[i] += moved(r, o, done[i], op_name, path)?;
                }
            }
            return Ok(());
        };
        loop {
            let pending: Vec<usize> = (0..ops.len()).filter(|&i| done[i] < want(&ops[i])).collect();
            if pending.is_empty() {
                return Ok(());
            }
            for wave in pending.chunks(RING_ENTRIES as usize) {
                for &i in wave {
                    let o = &ops[i];
                    let (at, n) = (done[i], (want(o) - done[i]).min(u64::from(u32::MAX)) as u32);
                    let p = ptr(o, at);
                    let fdt = io_uring::types::Fd(fd.as_raw_fd());
                    let chunk = (o.extent.offset + at) / FIXED_CHUNK;
                    let in_chunk = (o.extent.offset + at + u64::from(n)).div_ceil(FIXED_CHUNK) == chunk + 1;
                    let entry = match (write, self.fixed && in_chunk) {
                        (true, true) => {
                            io_uring::opcode::WriteFixed::new(fdt, p, n, chunk as u16).offset(o.offset + at).build()
                        }
                        (true, false) => io_uring::opcode::Write::new(fdt, p, n).offset(o.offset + at).build(),
                        (false, true) => {
                            io_uring::opcode::ReadFixed::new(fdt, p, n, chunk as u16).offset(o.offset + at).build()
                        }
                        (false, false) => io_uring::opcode::Read::new(fdt, p, n).offset(o.offset + at).build(),
                    };
                    // SAFETY: the buffer stays valid and untouched until its completion below.
                    let pushed = unsafe { ring.submission().push(&entry.user_data(i as u64)) };
                    if pushed.is_err() {
                        return Err(IoFailure::Io {
                            op: op_name,
                            path: path.into(),
                            error: "submission queue full".into(),
                        });
                    }
                }
                // Every operation of the wave completes before this returns, error or not: the
                // kernel must be done with the extents before the scheduler may reuse them.
                let mut results: Vec<(usize, i32)> = Vec::with_capacity(wave.len());
                let mut failure = None;
                while results.len() < wave.len() {
                    match ring.submit_and_wait(wave.len() - results.len()) {
                        Ok(_) => {}
                        Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => {}
                        Err(e) => {
                            failure.get_or_insert(IoFailure::Io {
                                op: op_name,
                                path: path.into(),
                                error: errno_text(&e),
                            });
                            std::thread::sleep(std::time::Duration::from_millis(1));
                        }
                    }
                    results.extend(ring.completion().map(|c| (c.user_data() as usize, c.result())));
                }
                if let Some(f) = failure {
                    return Err(f);
                }
                for (i, r) in results {
                    done[i] += moved(i64::from(r), &ops[i], done[i], op_name, path)?;
                }
            }
        }
    }

    fn write(
        &mut self,
        plan: &WritePlan,
        extents: &[HostExtent],
        id: &DiskIdentity,
        faults: IoFaults,
    ) -> Result<Vec<u64>, IoFailure> {
        let tmp = &plan.tmp_path;
        let io = |op, e: std::io::Error| IoFailure::Io { op, path: tmp.clone(), error: errno_text(&e) };
        let result = (|| {
            let fd = open(tmp, true).map_err(|e| io("open", e))?;
            let ops: Vec<Op> =
                plan.header.blocks.iter().zip(extents).map(|(b, &e)| Op { offset: b.offset, extent: e }).collect();
            self.transfer(&fd, &ops, true, tmp)?;
            if let Some(errno) = faults.write_errno {
                return Err(io("write", std::io::Error::from_raw_os_error(errno)));
            }
            // SAFETY: the extents are pinned for this job; nothing writes them meanwhile.
            let sums: Vec<u64> = extents.iter().map(|&e| checksum(unsafe { self.arena.bytes(e) })).collect();
            let mut header = plan.header.clone();
            for (b, &s) in header.blocks.iter_mut().zip(&sums) {
                b.checksum = s;
            }
            let bytes = header.encode(id);
            // O_DIRECT needs an aligned source: a scratch arena of the header's size.
            let scratch =
                HostArena::new(bytes.len() as u64).map_err(|e| io("header", std::io::Error::other(e.to_string())))?;
            let whole = HostExtent { offset: 0, len: bytes.len() as u64 };
            // SAFETY: the scratch arena is private to this call.
            unsafe { scratch.bytes_mut(whole) }.copy_from_slice(&bytes);
            write_all_at(&fd, &scratch, whole, 0, tmp)?;
            // SAFETY: an open descriptor.
            if unsafe { libc::fdatasync(fd.as_raw_fd()) } != 0 {
                return Err(io("fdatasync", std::io::Error::last_os_error()));
            }
            drop(fd);
            std::fs::rename(tmp, &plan.path).map_err(|e| io("rename", e))?;
            // The rename must be durable before a later file that references this one is.
            if let Some(dir) = plan.path.parent()
                && let Ok(d) = std::fs::File::open(dir)
            {
                let _ = d.sync_all();
            }
            Ok(sums)
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(tmp);
        }
        result
    }

    fn read(&mut self, reads: &[(BlockRead, HostExtent)], faults: IoFaults) -> Result<(), IoFailure> {
        // One open per file, blocks of a file in flight together.
        let mut files: Vec<&PathBuf> = reads.iter().map(|(r, _)| &r.path).collect();
        files.sort();
        files.dedup();
        for path in files {
            let io = |op, e: std::io::Error| IoFailure::Io { op, path: path.clone(), error: errno_text(&e) };
            if let Some(errno) = faults.read_errno {
                return Err(io("read", std::io::Error::from_raw_os_error(errno)));
            }
            let fd = open(path, false).map_err(|e| io("open", e))?;
            let mine: Vec<&(BlockRead, HostExtent)> = reads.iter().filter(|(r, _)| &r.path == path).collect();
            let ops: Vec<Op> = mine.iter().map(|(r, e)| Op { offset: r.offset, extent: *e }).collect();
            self.transfer(&fd, &ops, false, path)?;
            for (r, e) in mine {
                if faults.short_reads {
                    return Err(IoFailure::Short { path: path.clone(), offset: r.offset, got: r.len - 1, want: r.len });
                }
                if faults.flip_bits {
                    // SAFETY: the extent is owned by this job.
                    if let Some(b) = unsafe { self.arena.bytes_mut(*e) }.first_mut() {
                        *b ^= 1;
                    }
                }
                // SAFETY: as above.
                if checksum(unsafe { self.arena.bytes(*e) }) != r.checksum {
                    return Err(IoFailure::Checksum { path: path.clone(), offset: r.offset });
                }
            }
        }
        Ok(())
    }
}

/// Bytes one transfer moved, from its result (`-errno` on failure, 0 at end of file).
fn moved(result: i64, o: &Op, done: u64, op: &'static str, path: &Path) -> Result<u64, IoFailure> {
    match result {
        r if r < 0 => {
            let e = std::io::Error::from_raw_os_error((-r) as i32);
            Err(IoFailure::Io { op, path: path.into(), error: errno_text(&e) })
        }
        0 => Err(IoFailure::Short { path: path.into(), offset: o.offset, got: done, want: o.extent.span() }),
        r => Ok(r as u64),
    }
}

fn write_all_at(fd: &OwnedFd, arena: &HostArena, e: HostExtent, offset: u64, path: &Path) -> Result<(), IoFailure> {
    let mut at = 0;
    while at < e.len {
        // SAFETY: in bounds of the private scratch arena.
        let r = unsafe {
            libc::pwrite(
                fd.as_raw_fd(),
                arena.as_ptr().add(at as usize).cast(),
                (e.len - at) as usize,
                (offset + at) as i64,
            )
        };
        if r <= 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(IoFailure::Io { op: "write", path: path.into(), error: errno_text(&e) });
        }
        at += r as u64;
    }
    Ok(())
}
