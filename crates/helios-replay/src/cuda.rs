//! CUDA replay of a runtime core through the driver API (cudarc, loaded at run time, so
//! nothing here needs CUDA to build).
//!
//! [`DeviceCore::load`] reserves the core's arena at its recorded base address (falling
//! back to another address and patching every recorded relocation), maps physical memory as the
//! load-time plan says ([`crate::memory`]: the whole arena, or all of it but a KV-page tail when
//! free memory is short, serving fewer pages), uploads payloads, loads each kernel from its exact recorded image, rebuilds every graph
//! node by node (kernel, memcpy, memset, empty, event record/wait) with its launch
//! attributes and its edges (programmatic ones, execution ABI 4, as the driver's programmatic
//! kernel-node ports), instantiates and uploads them. After `load` returns, replay allocates
//! nothing.
//!
//! Invariants: graphs, modules, events and the arena live together and are destroyed only
//! after the stream drained (see `Drop`); every pointer word a kernel receives is one of the
//! core's relocations, rewritten for the actual base.

#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_void};
use std::time::Instant;

use cudarc::driver::sys as cu;
use helios_contract::RuntimeCore;
use helios_contract::model::{
    BufferId, BufferRole, Dependency, Edge, Graph, GraphId, ImageFormat, KernelId, LaunchAttribute, Manifest, NodeOp,
    Payload,
};

use crate::memory::plan_memory;
pub use crate::memory::{DRIVER_MARGIN_BYTES, MemoryPlan, PlanError};

/// Virtual reservations are made in whole units of this size.
const RESERVE_UNIT: usize = 1 << 30;

/// Oldest driver API accepted (CUDA 12.0).
pub const MIN_DRIVER_VERSION: i32 = 12000;

/// CUDA failures, with the driver's own code, name and description.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver library (libcuda.so) could be loaded")]
    NoDriver,
    #[error("CUDA driver API {found} is older than the required {required}")]
    DriverTooOld { found: i32, required: i32 },
    #[error("{op} failed: {name} ({code}): {description}")]
    Call { op: &'static str, code: u32, name: String, description: String },
    #[error("graph {graph} node {node}: {reason}")]
    Node { graph: u32, node: u32, reason: &'static str },
    /// The driver predates programmatic graph edges (CUDA 12.3); cudarc would panic calling it.
    #[error(
        "graph {graph} has programmatic edges, and this CUDA driver lacks cuGraphAddDependencies_v2 (CUDA 12.3 or later has it)"
    )]
    ProgrammaticEdgesUnsupported { graph: u32 },
    #[error("kernel {kernel}: {reason}")]
    Kernel { kernel: u32, reason: &'static str },
    #[error("buffer {0} is not in the core")]
    UnknownBuffer(u32),
    #[error("graph {0} is not in the core")]
    UnknownGraph(u32),
    #[error("buffer {buffer}: range {offset}+{len} outside its {size} bytes")]
    OutOfRange { buffer: u32, offset: u64, len: u64, size: u64 },
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error("the arena is not backed whole (KV pages were cut to fit): {0} needs every byte")]
    PartiallyBacked(&'static str),
    #[error("no deferred read {0} is outstanding")]
    UnknownRead(u64),
    #[error("a host transfer outside the attached host arena, or none is attached")]
    NoHostArena,
    #[error(transparent)]
    Device(#[from] helios_contract::DeviceMismatch),
}

fn error_text(r: cu::CUresult) -> (String, String) {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut desc: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: the driver returns pointers to static strings or leaves them null.
    unsafe {
        cu::cuGetErrorName(r, &mut name);
        cu::cuGetErrorString(r, &mut desc);
    }
    let text = |p: *const std::ffi::c_char| {
        if p.is_null() {
            String::from("unknown")
        } else {
            // SAFETY: non-null driver strings are NUL-terminated and static.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    (text(name), text(desc))
}

fn check(op: &'static str, r: cu::CUresult) -> Result<(), CudaError> {
    if r == cu::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let (name, description) = error_text(r);
    Err(CudaError::Call { op, code: r as u32, name, description })
}

/// Loads the driver library and initializes it; typed errors when absent or too old.
pub fn init_driver() -> Result<i32, CudaError> {
    // SAFETY: probing for the library has no preconditions.
    if !unsafe { cu::is_culib_present() } {
        return Err(CudaError::NoDriver);
    }
    // SAFETY: the library is present; cuInit may be called repeatedly.
    check("cuInit", unsafe { cu::cuInit(0) })?;
    let mut version = 0;
    // SAFETY: out-pointer to a live local.
    check("cuDriverGetVersion", unsafe { cu::cuDriverGetVersion(&mut version) })?;
    if version < MIN_DRIVER_VERSION {
        return Err(CudaError::DriverTooOld { found: version, required: MIN_DRIVER_VERSION });
    }
    Ok(version)
}

/// The device a core would be prepared for and served on: its name, compute capability and
/// the driver version (a prepared core is specific to all three). `Ok(None)`: a driver but no
/// device at `ordinal`.
pub fn device_identity(ordinal: i32) -> Result<Option<String>, CudaError> {
    let driver = init_driver()?;
    let mut count = 0;
    // SAFETY: out-pointer to a live local; the driver is initialized.
    check("cuDeviceGetCount", unsafe { cu::cuDeviceGetCount(&mut count) })?;
    if ordinal >= count {
        return Ok(None);
    }
    let mut device = 0;
    let mut name = [0 as std::ffi::c_char; 256];
    let (mut major, mut minor) = (0, 0);
    // SAFETY: out-pointers to live locals and a 256-byte buffer; the ordinal is in range.
    unsafe {
        check("cuDeviceGet", cu::cuDeviceGet(&mut device, ordinal))?;
        check("cuDeviceGetName", cu::cuDeviceGetName(name.as_mut_ptr(), 256, device))?;
        use cu::CUdevice_attribute::{
            CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR as MAJOR,
            CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR as MINOR,
        };
        check("cuDeviceGetAttribute", cu::cuDeviceGetAttribute(&mut major, MAJOR, device))?;
        check("cuDeviceGetAttribute", cu::cuDeviceGetAttribute(&mut minor, MINOR, device))?;
    }
    // SAFETY: the driver wrote a NUL-terminated string into the buffer.
    let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
    Ok(Some(format!("{name} sm_{major}{minor} driver {driver}")))
}

/// The device's compute capability, which a core's kernel images are built for.
fn compute_capability(device: cu::CUdevice) -> Result<(u32, u32), CudaError> {
    use cu::CUdevice_attribute::{
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR as MAJOR, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR as MINOR,
    };
    let (mut major, mut minor) = (0, 0);
    // SAFETY: out-pointers to live locals; the device handle is valid.
    unsafe {
        check("cuDeviceGetAttribute", cu::cuDeviceGetAttribute(&mut major, MAJOR, device))?;
        check("cuDeviceGetAttribute", cu::cuDeviceGetAttribute(&mut minor, MINOR, device))?;
    }
    let nonneg = |v: i32| u32::try_from(v).unwrap_or(0);
    Ok((nonneg(major), nonneg(minor)))
}

/// How to load.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadOptions {
    pub device_ordinal: i32,
    /// Device memory left to other users of the GPU (`flare run --gpu-reserve-gib`).
    pub reserve_bytes: u64,
    /// Reserve the arena anywhere but the recorded base (exercises relocation).
    pub force_relocation: bool,
    pub upload: UploadPath,
    /// Called as the payload upload advances: after each further tenth of the bytes has been
    /// staged, and once when every copy has landed.
    pub progress: Option<fn(UploadProgress)>,
}

/// How payload bytes travel from the core's mmap to the arena.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UploadPath {
    /// [`UploadPath::Staged`] for payloads of at least [`STAGED_UPLOAD_MIN_BYTES`], else
    /// [`UploadPath::Direct`]; the report names the path taken.
    #[default]
    Auto,
    /// Through two reusable page-locked slots of [`UPLOAD_SLOT_BYTES`] on the copy stream:
    /// host threads fill one slot from the mmap while the other slot's copy runs. The slots
    /// are allocated for the upload and freed before readiness.
    Staged,
    /// One synchronous pageable `cuMemcpyHtoD` per buffer straight from the mmap: the baseline
    /// the `core_load` bench measures the staged path against.
    Direct,
}

/// Smallest payload [`UploadPath::Auto`] stages. Pinning the slots costs a fixed ~50 ms, so
/// staging wins only on large payloads (H200, `core_load`, 2026-12-04: 2,050 MiB staged 0.174 s
/// vs direct 0.268 s; 262 MiB staged 0.071 s vs direct 0.043 s; break-even near 600 MiB).
pub const STAGED_UPLOAD_MIN_BYTES: u64 = 512 << 20;

impl UploadPath {
    /// The path a payload of `total` bytes takes ([`UploadPath::Auto`] resolved).
    pub fn for_payload(self, total: u64) -> UploadPath {
        match self {
            UploadPath::Auto if total >= STAGED_UPLOAD_MIN_BYTES => UploadPath::Staged,
            UploadPath::Auto => UploadPath::Direct,
            chosen => chosen,
        }
    }
}

/// Largest size of one of the two upload staging slots.
pub const UPLOAD_SLOT_BYTES: usize = 32 << 20;

/// Host threads that fill an upload slot (each copies a contiguous part of it).
const UPLOAD_FILL_THREADS: usize = 4;

/// Where a payload upload stands.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UploadProgress {
    /// Bytes handed to the copy engine so far (all of them, landed, when `done`).
    pub staged_bytes: u64,
    pub total_bytes: u64,
    pub elapsed_seconds: f64,
    pub done: bool,
}

/// Calls the progress hook at each further tenth of the bytes and at the end.
struct ProgressMeter {
    hook: Option<fn(UploadProgress)>,
    total: u64,
    staged: u64,
    next_tenth: u64,
    started: Instant,
}

impl ProgressMeter {
    fn new(hook: Option<fn(UploadProgress)>, total: u64) -> Self {
        ProgressMeter { hook, total, staged: 0, next_tenth: 1, started: Instant::now() }
    }

    fn staged(&mut self, bytes: u64) {
        self.staged += bytes;
        let Some(hook) = self.hook else { return };
        let mut crossed = false;
        while self.next_tenth < 10 && self.staged * 10 >= self.total * self.next_tenth {
            self.next_tenth += 1;
            crossed = true;
        }
        if crossed {
            hook(self.report(false));
        }
    }

    fn finish(&mut self) {
        if let Some(hook) = self.hook {
            hook(self.report(true));
        }
    }

    fn report(&self, done: bool) -> UploadProgress {
        UploadProgress {
            staged_bytes: self.staged,
            total_bytes: self.total,
            elapsed_seconds: self.started.elapsed().as_secs_f64(),
            done,
        }
    }
}

/// `[0, len)` as consecutive ranges of at most `slot` bytes.
fn slot_ranges(len: usize, slot: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..len.div_ceil(slot)).map(move |i| i * slot..((i + 1) * slot).min(len))
}

/// Copies `src` into `dst` (same length) with up to `threads` threads, one contiguous part each.
fn parallel_copy(dst: &mut [u8], src: &[u8], threads: usize) {
    debug_assert_eq!(dst.len(), src.len());
    let part = src.len().div_ceil(threads.max(1)).max(1 << 20);
    if part >= src.len() {
        dst.copy_from_slice(src);
        return;
    }
    std::thread::scope(|s| {
        for (d, from) in dst.chunks_mut(part).zip(src.chunks(part)) {
            s.spawn(move || d.copy_from_slice(from));
        }
    });
}

/// The two page-locked upload slots and their copy-done events; drained and freed on drop.
struct UploadSlots {
    stream: cu::CUstream,
    /// Bytes per slot: [`UPLOAD_SLOT_BYTES`], or less for small payloads (pinning costs about
    /// 50 ms for the full size, measured on the H200).
    slot: usize,
    pinned: *mut u8,
    events: [cu::CUevent; 2],
    pending: [bool; 2],
}

impl UploadSlots {
    fn new(stream: cu::CUstream, total: u64) -> Result<Self, CudaError> {
        let slot = usize::try_from(total)
            .unwrap_or(usize::MAX)
            .div_ceil(2)
            .next_multiple_of(4096)
            .clamp(4096, UPLOAD_SLOT_BYTES);
        let mut me = UploadSlots {
            stream,
            slot,
            pinned: std::ptr::null_mut(),
            events: [std::ptr::null_mut(); 2],
            pending: [false; 2],
        };
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-pointer to a live local; the context is current.
        check("cuMemAllocHost", unsafe { cu::cuMemAllocHost_v2(&mut p, 2 * slot) })?;
        me.pinned = p.cast();
        for e in &mut me.events {
            // SAFETY: out-pointer to a field; flags 2 = CU_EVENT_DISABLE_TIMING.
            check("cuEventCreate", unsafe { cu::cuEventCreate(e, 2) })?;
        }
        Ok(me)
    }

    /// Copies `src` (at most one slot) to device address `dst` through slot `slot`, first
    /// waiting for that slot's previous copy to finish reading it.
    fn send(&mut self, slot: usize, src: &[u8], dst: u64) -> Result<(), CudaError> {
        debug_assert!(src.len() <= self.slot);
        if self.pending[slot] {
            // SAFETY: the event is live and was recorded.
            check("cuEventSynchronize", unsafe { cu::cuEventSynchronize(self.events[slot]) })?;
            self.pending[slot] = false;
        }
        // SAFETY: the slot lies inside the allocation and no copy reads it any more (above).
        let staging = unsafe { std::slice::from_raw_parts_mut(self.pinned.add(slot * self.slot), src.len()) };
        parallel_copy(staging, src, UPLOAD_FILL_THREADS);
        // SAFETY: the source is page-locked and stays untouched until the event below completes;
        // dst..dst+len is mapped arena memory.
        check("cuMemcpyHtoDAsync", unsafe {
            cu::cuMemcpyHtoDAsync_v2(dst, staging.as_ptr().cast(), src.len(), self.stream)
        })?;
        // SAFETY: event and stream are live.
        check("cuEventRecord", unsafe { cu::cuEventRecord(self.events[slot], self.stream) })?;
        self.pending[slot] = true;
        Ok(())
    }
}

impl Drop for UploadSlots {
    fn drop(&mut self) {
        // SAFETY: the copies reading the slots finish before the slots are freed; every handle
        // was created by `new` (or is null) and is released once.
        unsafe {
            cu::cuStreamSynchronize(self.stream);
            for &e in &self.events {
                if !e.is_null() {
                    cu::cuEventDestroy_v2(e);
                }
            }
            if !self.pinned.is_null() {
                cu::cuMemFreeHost(self.pinned.cast());
            }
        }
    }
}

/// What loading did and cost.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadReport {
    pub driver_version: i32,
    pub recorded_base: u64,
    pub base: u64,
    pub arena_bytes: u64,
    /// Pointer words rewritten (all of them, at any base; at the recorded base they are verified equal).
    pub relocated_words: usize,
    pub uploaded_bytes: u64,
    pub kernels: usize,
    pub graphs: usize,
    pub nodes: usize,
    /// Programmatic and launch-order edges rebuilt as such (execution ABI 4).
    pub programmatic_edges: usize,
    /// The path the payload took (never [`UploadPath::Auto`]).
    pub upload_path: UploadPath,
    pub upload_seconds: f64,
    pub build_seconds: f64,
    /// Page-locked staging allocated at load for step metadata and records.
    pub pinned_staging_bytes: u64,
    /// Device memory in use (all processes) once loading finished.
    pub device_used_bytes: u64,
    /// KV pages physically backed and served (fewer than the core's when memory was short).
    pub kv_pages: u32,
    /// Arena bytes physically backed.
    pub backed_bytes: u64,
}

/// Reads in flight keep at most this many events.
const READ_EVENTS: usize = 64;

/// A device-to-host copy into the pinned ring, or its bytes once copied out of the ring.
enum DeferredRead {
    InFlight { event: usize, at: usize, len: usize },
    Done(Vec<u8>),
}

struct DeviceGraph {
    graph: cu::CUgraph,
    exec: cu::CUgraphExec,
    events: Vec<cu::CUevent>,
}

/// A core resident on one device, ready to replay.
pub struct DeviceCore {
    manifest: Manifest,
    device: cu::CUdevice,
    context: cu::CUcontext,
    /// Replays and everything ordered with them: step inputs, completion-record reads, state copies.
    stream: cu::CUstream,
    /// Bulk transfers not ordered with replays (the load-time upload), so they never queue
    /// behind or in front of a step.
    copy_stream: cu::CUstream,
    base: u64,
    reserved: usize,
    /// Backed ranges of the arena: (offset, length, physical allocation).
    mappings: Vec<(u64, usize, cu::CUmemGenericAllocationHandle)>,
    /// The unbacked KV tail, as arena offsets, when pages were cut.
    hole: Option<(u64, u64)>,
    modules: Vec<cu::CUmodule>,
    graphs: HashMap<GraphId, DeviceGraph>,
    report: LoadReport,
    /// Reusable page-locked staging for the executor's copies, in two halves, bump-allocated.
    /// Leaving a half records `half_left[h]`; a half is reused only after that event completed
    /// and its deferred reads were copied out, so no region is rewritten while a copy or the
    /// host may still read it.
    pinned: *mut u8,
    pinned_len: usize,
    pinned_at: usize,
    half_left: [cu::CUevent; 2],
    half_recorded: [bool; 2],
    /// Events for deferred reads, created at load (none after readiness).
    read_events: Vec<cu::CUevent>,
    free_read_events: Vec<usize>,
    reads: HashMap<u64, DeferredRead>,
    next_read: u64,
    /// Device memory in use when loading finished (for the after-readiness growth check).
    used_at_ready: u64,
    /// The host tier's arena, page-locked (registered) while attached.
    host: Option<std::sync::Arc<helios_offload::HostArena>>,
    /// Restores copy in on the copy stream, overlapping the step's replays: `transfer_events[0]`
    /// orders each copy after the model stream's work so far, `[1]` makes the model stream wait
    /// for the copies at the end of the step (created when the arena is attached).
    transfer_events: [cu::CUevent; 2],
    copies_pending: bool,
}

impl std::fmt::Debug for DeviceCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceCore").field("report", &self.report).finish_non_exhaustive()
    }
}

fn granularity(device: cu::CUdevice) -> Result<(cu::CUmemAllocationProp, usize), CudaError> {
    // SAFETY: a zeroed property struct is a valid starting value; fields set below.
    let mut prop: cu::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    let mut g = 0usize;
    // SAFETY: out-pointer to a live local; prop is initialized.
    check("cuMemGetAllocationGranularity", unsafe {
        cu::cuMemGetAllocationGranularity(
            &mut g,
            &prop,
            cu::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    })?;
    Ok((prop, g.max(1)))
}

impl DeviceCore {
    /// Loads `core` onto the device; see the module documentation.
    pub fn load(core: &RuntimeCore, options: &LoadOptions) -> Result<DeviceCore, CudaError> {
        let driver_version = init_driver()?;
        let manifest = core.manifest().clone();
        let mut device = 0;
        let mut context = std::ptr::null_mut();
        // SAFETY: out-pointers to live locals; the driver is initialized.
        unsafe {
            check("cuDeviceGet", cu::cuDeviceGet(&mut device, options.device_ordinal))?;
        }
        manifest.identity.device.check_serving_device(compute_capability(device)?)?;
        // SAFETY: out-pointers to live locals; the device handle is valid.
        unsafe {
            check("cuDevicePrimaryCtxRetain", cu::cuDevicePrimaryCtxRetain(&mut context, device))?;
            check("cuCtxSetCurrent", cu::cuCtxSetCurrent(context))?;
        }
        let mut me = DeviceCore {
            manifest,
            device,
            context,
            stream: std::ptr::null_mut(),
            copy_stream: std::ptr::null_mut(),
            base: 0,
            reserved: 0,
            mappings: Vec::new(),
            hole: None,
            modules: Vec::new(),
            graphs: HashMap::new(),
            report: LoadReport { driver_version, ..LoadReport::default() },
            pinned: std::ptr::null_mut(),
            pinned_len: 0,
            pinned_at: 0,
            half_left: [std::ptr::null_mut(); 2],
            half_recorded: [false; 2],
            read_events: Vec::new(),
            free_read_events: Vec::new(),
            reads: HashMap::new(),
            next_read: 0,
            used_at_ready: 0,
            host: None,
            transfer_events: [std::ptr::null_mut(); 2],
            copies_pending: false,
        };
        // From here on, Drop releases whatever was created.
        // SAFETY: out-pointer to a field; the context is current.
        check("cuStreamCreate", unsafe { cu::cuStreamCreate(&mut me.stream, 1) })?;
        // SAFETY: as above.
        check("cuStreamCreate", unsafe { cu::cuStreamCreate(&mut me.copy_stream, 1) })?;
        me.alloc_pinned()?;
        me.create_events()?;
        me.map_arena(options)?;
        let t0 = Instant::now();
        me.upload(core, options)?;
        me.report.upload_seconds = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let functions = me.load_kernels(core)?;
        let graphs = me.manifest.graphs.clone();
        for g in &graphs {
            me.build_graph(g, &functions)?;
        }
        // SAFETY: the stream is live.
        check("cuStreamSynchronize", unsafe { cu::cuStreamSynchronize(me.stream) })?;
        // Direct payload copies run on the legacy stream, which the non-blocking model stream
        // does not wait for: finish everything before the core is ready.
        // SAFETY: the context is current.
        check("cuCtxSynchronize", unsafe { cu::cuCtxSynchronize() })?;
        me.report.build_seconds = t1.elapsed().as_secs_f64();
        me.used_at_ready = me.device_used_bytes()?;
        me.report.device_used_bytes = me.used_at_ready;
        Ok(me)
    }

    fn map_arena(&mut self, options: &LoadOptions) -> Result<(), CudaError> {
        let (prop, g) = granularity(self.device)?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: out-pointers to live locals; the context is current.
        check("cuMemGetInfo", unsafe { cu::cuMemGetInfo_v2(&mut free, &mut total) })?;
        let plan = plan_memory(&self.manifest, g as u64, free as u64, options.reserve_bytes)?;
        let size = plan.arena_bytes as usize;
        // The driver serves small reservations from its own pool and ignores their hint;
        // whole-GiB reservations honour it (measured). Only the plan's ranges are backed.
        let reserve = size.div_ceil(RESERVE_UNIT) * RESERVE_UNIT;
        let recorded = self.manifest.arena.base_address;
        let hint = if options.force_relocation { 0 } else { recorded };
        let mut ptr: cu::CUdeviceptr = 0;
        // SAFETY: out-pointer to a live local; the hint is only a request.
        check("cuMemAddressReserve", unsafe { cu::cuMemAddressReserve(&mut ptr, reserve, 0, hint, 0) })?;
        if options.force_relocation && ptr == recorded {
            // The driver honoured a hint we did not give; ask again at a different place.
            let mut other: cu::CUdeviceptr = 0;
            // SAFETY: as above.
            check("cuMemAddressReserve", unsafe { cu::cuMemAddressReserve(&mut other, reserve, 0, 0, 0) })?;
            // SAFETY: ptr was reserved above with this size.
            check("cuMemAddressFree", unsafe { cu::cuMemAddressFree(ptr, reserve) })?;
            ptr = other;
        }
        self.base = ptr;
        self.reserved = reserve;
        self.hole = plan.hole;
        let ranges: Vec<(u64, u64)> = match plan.hole {
            None => vec![(0, size as u64)],
            Some((start, end)) => [(0, start), (end, size as u64)].into_iter().filter(|(a, b)| b > a).collect(),
        };
        let access = cu::CUmemAccessDesc {
            location: prop.location,
            flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        for (start, end) in ranges {
            let len = (end - start) as usize;
            let mut handle: cu::CUmemGenericAllocationHandle = 0;
            // SAFETY: prop is initialized; handle is an out-pointer.
            check("cuMemCreate", unsafe { cu::cuMemCreate(&mut handle, len, &prop, 0) })?;
            // SAFETY: [ptr+start, ptr+end) is reserved, granularity-aligned and unmapped; the handle has `len` bytes.
            let mapped = unsafe { cu::cuMemMap(ptr + start, len, 0, handle, 0) };
            if let Err(e) = check("cuMemMap", mapped) {
                // SAFETY: the handle was created above and is mapped nowhere.
                unsafe { cu::cuMemRelease(handle) };
                return Err(e);
            }
            self.mappings.push((start, len, handle));
            // SAFETY: the range is mapped; one descriptor.
            check("cuMemSetAccess", unsafe { cu::cuMemSetAccess(ptr + start, len, &access, 1) })?;
        }
        self.report.recorded_base = recorded;
        self.report.base = ptr;
        self.report.arena_bytes = size as u64;
        self.report.backed_bytes = plan.backed_bytes;
        self.report.kv_pages = plan.kv_pages;
        Ok(())
    }

    /// `[offset, offset + len)` minus the unbacked hole: the parts a fill may touch.
    fn backed_parts(&self, offset: u64, len: u64) -> Vec<(u64, u64)> {
        let end = offset + len;
        match self.hole {
            Some((s, e)) if offset < e && s < end => {
                [(offset, s.max(offset)), (e.min(end), end)].into_iter().filter(|(a, b)| b > a).collect()
            }
            _ => vec![(offset, end)],
        }
    }

    /// Payload bytes into the arena and zero fills, finished before returning. The staged path
    /// runs on the copy stream, so the model stream never waits behind it.
    fn upload(&mut self, core: &RuntimeCore, options: &LoadOptions) -> Result<(), CudaError> {
        let buffers = self.manifest.buffers.clone();
        let mut payloads = Vec::new();
        for b in &buffers {
            if let Payload::Safetensors { .. } = &b.payload {
                let bytes = core.payload(b.id).ok_or(CudaError::UnknownBuffer(b.id.0))?;
                payloads.push((self.base + b.offset, bytes));
            }
        }
        let total = payloads.iter().map(|(_, bytes)| bytes.len() as u64).sum();
        let mut meter = ProgressMeter::new(options.progress, total);
        let path = options.upload.for_payload(total);
        self.report.upload_path = path;
        match path {
            UploadPath::Direct => {
                for &(addr, bytes) in &payloads {
                    // SAFETY: addr..addr+len lies inside the mapped arena (validated buffer
                    // extents); the source is a live mmap slice.
                    check("cuMemcpyHtoD", unsafe { cu::cuMemcpyHtoD_v2(addr, bytes.as_ptr().cast(), bytes.len()) })?;
                    meter.staged(bytes.len() as u64);
                }
            }
            UploadPath::Staged | UploadPath::Auto => {
                let mut slots = UploadSlots::new(self.copy_stream, total)?;
                let mut slot = 0;
                for &(addr, bytes) in &payloads {
                    for r in slot_ranges(bytes.len(), slots.slot) {
                        let (offset, len) = (r.start as u64, r.len() as u64);
                        slots.send(slot, &bytes[r], addr + offset)?;
                        slot ^= 1;
                        meter.staged(len);
                    }
                }
                drop(slots); // drains the copy stream before the slots are freed
            }
        }
        self.report.uploaded_bytes = total;
        for b in buffers.iter().filter(|b| matches!(b.payload, Payload::ZeroFill)) {
            for (start, end) in self.backed_parts(b.offset, b.byte_size) {
                // SAFETY: the part lies inside a backed range of the arena.
                check("cuMemsetD8Async", unsafe {
                    cu::cuMemsetD8Async(self.base + start, 0, (end - start) as usize, self.copy_stream)
                })?;
            }
        }
        // SAFETY: the stream is live.
        check("cuStreamSynchronize", unsafe { cu::cuStreamSynchronize(self.copy_stream) })?;
        meter.finish();
        Ok(())
    }

    fn load_kernels(&mut self, core: &RuntimeCore) -> Result<HashMap<KernelId, cu::CUfunction>, CudaError> {
        let mut functions = HashMap::new();
        let kernels = self.manifest.kernels.clone();
        for k in &kernels {
            let image = core.kernel_image(k.id).ok_or(CudaError::Kernel { kernel: k.id.0, reason: "no image" })?;
            // PTX is text and must be NUL-terminated; cubin/fatbin are passed as recorded.
            let mut owned;
            let bytes: &[u8] = if k.format == ImageFormat::Ptx && image.last() != Some(&0) {
                owned = image.to_vec();
                owned.push(0);
                &owned
            } else {
                image
            };
            let mut module = std::ptr::null_mut();
            // SAFETY: the image bytes outlive the call; the context is current.
            check("cuModuleLoadData", unsafe { cu::cuModuleLoadData(&mut module, bytes.as_ptr().cast()) })?;
            self.modules.push(module);
            let name = CString::new(k.function_name.clone())
                .map_err(|_| CudaError::Kernel { kernel: k.id.0, reason: "function name contains NUL" })?;
            let mut f = std::ptr::null_mut();
            // SAFETY: module is loaded; name is NUL-terminated.
            check("cuModuleGetFunction", unsafe { cu::cuModuleGetFunction(&mut f, module, name.as_ptr()) })?;
            if k.max_dynamic_shared_memory > 0 {
                // SAFETY: f is a live function handle.
                check("cuFuncSetAttribute", unsafe {
                    cu::cuFuncSetAttribute(
                        f,
                        cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        k.max_dynamic_shared_memory as i32,
                    )
                })?;
            }
            functions.insert(k.id, f);
        }
        self.report.kernels = kernels.len();
        Ok(functions)
    }

    fn address(&self, buffer: BufferId, offset: u64) -> Result<u64, CudaError> {
        let b = self.manifest.buffer(buffer).ok_or(CudaError::UnknownBuffer(buffer.0))?;
        Ok(self.base + b.offset + offset)
    }

    fn build_graph(&mut self, g: &Graph, functions: &HashMap<KernelId, cu::CUfunction>) -> Result<(), CudaError> {
        let mut graph = std::ptr::null_mut();
        // SAFETY: out-pointer; flags must be 0.
        check("cuGraphCreate", unsafe { cu::cuGraphCreate(&mut graph, 0) })?;
        let mut dg = DeviceGraph { graph, exec: std::ptr::null_mut(), events: Vec::new() };
        let built = self.populate(g, &mut dg, functions);
        if let Err(e) = built {
            destroy_graph(&dg);
            return Err(e);
        }
        // SAFETY: graph is complete; exec is an out-pointer.
        let r = unsafe { cu::cuGraphInstantiateWithFlags(&mut dg.exec, dg.graph, 0) };
        if let Err(e) = check("cuGraphInstantiateWithFlags", r) {
            destroy_graph(&dg);
            return Err(e);
        }
        // SAFETY: exec and stream are live.
        let r = unsafe { cu::cuGraphUpload(dg.exec, self.stream) };
        self.graphs.insert(g.id, dg);
        check("cuGraphUpload", r)?;
        self.report.graphs += 1;
        self.report.nodes += g.nodes.len();
        self.report.programmatic_edges += g.programmatic_edges().count();
        Ok(())
    }

    fn populate(
        &mut self,
        g: &Graph,
        dg: &mut DeviceGraph,
        functions: &HashMap<KernelId, cu::CUfunction>,
    ) -> Result<(), CudaError> {
        for _ in 0..g.event_count {
            let mut e = std::ptr::null_mut();
            // SAFETY: out-pointer; flags: disable timing (graph events synchronize only).
            check("cuEventCreate", unsafe { cu::cuEventCreate(&mut e, 2) })?;
            dg.events.push(e);
        }
        let order = topological(g).ok_or(CudaError::Node { graph: g.id.0, node: 0, reason: "cycle" })?;
        let mut handles: Vec<cu::CUgraphNode> = vec![std::ptr::null_mut(); g.nodes.len()];
        for i in order {
            let node = &g.nodes[i];
            // A node is added with its full dependencies; programmatic edges join afterwards.
            let deps: Vec<cu::CUgraphNode> = g
                .edges
                .iter()
                .filter(|e| e.to == i && e.dependency == Dependency::Full)
                .map(|e| handles[e.from])
                .collect();
            let mut h = std::ptr::null_mut();
            let bad = |reason| CudaError::Node { graph: g.id.0, node: node.id, reason };
            match &node.op {
                NodeOp::Kernel(k) => {
                    let image = self.manifest.kernels.iter().find(|x| x.id == k.kernel).ok_or(bad("unknown kernel"))?;
                    let f = *functions.get(&k.kernel).ok_or(bad("unknown kernel"))?;
                    let mut params = k.param_bytes.clone();
                    for r in &k.relocations {
                        let slot = image.params.get(r.param_index as usize).ok_or(bad("relocation slot"))?;
                        let at = (slot.offset + r.byte_offset) as usize;
                        let word = params.get_mut(at..at + 8).ok_or(bad("relocation outside parameters"))?;
                        word.copy_from_slice(&self.address(r.buffer, r.buffer_offset)?.to_le_bytes());
                        self.report.relocated_words += 1;
                    }
                    let mut size = params.len();
                    let mut extra: [*mut c_void; 5] = [
                        cu::CU_LAUNCH_PARAM_BUFFER_POINTER_AS_INT as usize as *mut c_void,
                        params.as_mut_ptr().cast(),
                        cu::CU_LAUNCH_PARAM_BUFFER_SIZE_AS_INT as usize as *mut c_void,
                        (&mut size as *mut usize).cast(),
                        cu::CU_LAUNCH_PARAM_END_AS_INT as usize as *mut c_void,
                    ];
                    // SAFETY: zeroed is valid for this POD struct (null kern/ctx: use func).
                    let mut p: cu::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
                    p.func = f;
                    (p.gridDimX, p.gridDimY, p.gridDimZ) = (k.grid.x, k.grid.y, k.grid.z);
                    (p.blockDimX, p.blockDimY, p.blockDimZ) = (k.block.x, k.block.y, k.block.z);
                    p.sharedMemBytes = k.dynamic_shared_memory;
                    p.extra = extra.as_mut_ptr();
                    // SAFETY: params, size and extra outlive the call (the driver copies them).
                    check("cuGraphAddKernelNode", unsafe {
                        cu::cuGraphAddKernelNode_v2(&mut h, dg.graph, deps.as_ptr(), deps.len(), &p)
                    })?;
                    for a in &k.launch_attributes {
                        set_launch_attribute(h, a).map_err(|_| bad("launch attribute rejected"))?;
                    }
                }
                NodeOp::Memcpy { src, dst, byte_count } => {
                    let null: *mut c_void = std::ptr::null_mut();
                    // Device-to-device, one row: every field spelled out (enum fields have no zero value).
                    let p = cu::CUDA_MEMCPY3D {
                        srcXInBytes: 0,
                        srcY: 0,
                        srcZ: 0,
                        srcLOD: 0,
                        srcMemoryType: cu::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                        srcHost: std::ptr::null(),
                        srcDevice: self.address(src.buffer, src.offset)?,
                        srcArray: null.cast(),
                        reserved0: null,
                        srcPitch: 0,
                        srcHeight: 0,
                        dstXInBytes: 0,
                        dstY: 0,
                        dstZ: 0,
                        dstLOD: 0,
                        dstMemoryType: cu::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                        dstHost: null,
                        dstDevice: self.address(dst.buffer, dst.offset)?,
                        dstArray: null.cast(),
                        reserved1: null,
                        dstPitch: 0,
                        dstHeight: 0,
                        WidthInBytes: *byte_count as usize,
                        Height: 1,
                        Depth: 1,
                    };
                    // SAFETY: both ranges lie in the mapped arena (validated extents).
                    check("cuGraphAddMemcpyNode", unsafe {
                        cu::cuGraphAddMemcpyNode(&mut h, dg.graph, deps.as_ptr(), deps.len(), &p, self.context)
                    })?;
                }
                NodeOp::Memset { dst, value, element_size, width, height, pitch } => {
                    let p = cu::CUDA_MEMSET_NODE_PARAMS {
                        dst: self.address(dst.buffer, dst.offset)?,
                        pitch: *pitch as usize,
                        value: *value,
                        elementSize: *element_size,
                        width: *width as usize,
                        height: *height as usize,
                    };
                    // SAFETY: the range lies in the mapped arena (validated extents).
                    check("cuGraphAddMemsetNode", unsafe {
                        cu::cuGraphAddMemsetNode(&mut h, dg.graph, deps.as_ptr(), deps.len(), &p, self.context)
                    })?;
                }
                NodeOp::Empty => {
                    // SAFETY: dependencies are live nodes of this graph.
                    check("cuGraphAddEmptyNode", unsafe {
                        cu::cuGraphAddEmptyNode(&mut h, dg.graph, deps.as_ptr(), deps.len())
                    })?;
                }
                NodeOp::EventRecord { event } | NodeOp::EventWait { event } => {
                    let e = *dg.events.get(*event as usize).ok_or(bad("event index"))?;
                    let r = if matches!(node.op, NodeOp::EventRecord { .. }) {
                        // SAFETY: e is a live event; dependencies are nodes of this graph.
                        unsafe { cu::cuGraphAddEventRecordNode(&mut h, dg.graph, deps.as_ptr(), deps.len(), e) }
                    } else {
                        // SAFETY: as above.
                        unsafe { cu::cuGraphAddEventWaitNode(&mut h, dg.graph, deps.as_ptr(), deps.len(), e) }
                    };
                    check("cuGraphAddEventNode", r)?;
                }
            }
            handles[i] = h;
        }
        add_programmatic_edges(g, dg.graph, &handles)
    }

    /// The load report.
    pub fn report(&self) -> &LoadReport {
        &self.report
    }

    /// The arena's actual base address.
    pub fn base(&self) -> u64 {
        self.base
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Whether the device shares physical memory with the host (integrated GPUs, unified-memory
    /// systems): a host copy of device data then costs the same DRAM.
    pub fn integrated(&self) -> Result<bool, CudaError> {
        let mut v = 0;
        // SAFETY: out-pointer to a live local; the device handle is valid.
        check("cuDeviceGetAttribute", unsafe {
            cu::cuDeviceGetAttribute(&mut v, cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_INTEGRATED, self.device)
        })?;
        Ok(v != 0)
    }

    /// Page-locks `arena` so transfers to and from it run asynchronously: copies out on the
    /// model stream (the storage they read may be reused by the same step), copies in on the
    /// copy stream. Before readiness only: registering maps memory for the device, and the
    /// ordering events are created here.
    pub fn attach_host_arena(&mut self, arena: std::sync::Arc<helios_offload::HostArena>) -> Result<(), CudaError> {
        self.detach_host_arena();
        for e in &mut self.transfer_events {
            if e.is_null() {
                // SAFETY: out-pointer to a field; the context is current.
                check("cuEventCreate", unsafe {
                    cu::cuEventCreate(e, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
                })?;
            }
        }
        // SAFETY: the arena's memory is live for as long as the Arc this object keeps.
        check("cuMemHostRegister", unsafe {
            cu::cuMemHostRegister_v2(arena.as_ptr().cast(), arena.len() as usize, 0)
        })?;
        self.host = Some(arena);
        // Still before readiness: whatever the registration and the events cost on the device
        // is part of the baseline the after-readiness growth check compares against.
        self.used_at_ready = self.device_used_bytes()?;
        Ok(())
    }

    fn detach_host_arena(&mut self) {
        if let Some(arena) = self.host.take() {
            // SAFETY: drained first, so no copy still reads or writes the registered memory.
            unsafe {
                cu::cuStreamSynchronize(self.stream);
                cu::cuStreamSynchronize(self.copy_stream);
                cu::cuMemHostUnregister(arena.as_ptr().cast());
            }
        }
    }

    fn host_ptr(&self, extent: helios_offload::HostExtent) -> Result<*mut u8, CudaError> {
        let arena = self.host.as_ref().ok_or(CudaError::NoHostArena)?;
        if extent.offset.checked_add(extent.len).is_none_or(|end| end > arena.len()) {
            return Err(CudaError::NoHostArena);
        }
        // SAFETY: in bounds of the arena (checked).
        Ok(unsafe { arena.as_ptr().add(extent.offset as usize) })
    }

    fn range(&self, buffer: BufferId, offset: u64, len: u64) -> Result<u64, CudaError> {
        let b = self.manifest.buffer(buffer).ok_or(CudaError::UnknownBuffer(buffer.0))?;
        if offset.checked_add(len).is_none_or(|end| end > b.byte_size) {
            return Err(CudaError::OutOfRange { buffer: buffer.0, offset, len, size: b.byte_size });
        }
        let start = b.offset + offset;
        if self.hole.is_some_and(|(s, e)| start < e && s < start + len) {
            return Err(CudaError::PartiallyBacked("a copy into the unbacked KV tail"));
        }
        Ok(self.base + start)
    }

    fn alloc_pinned(&mut self) -> Result<(), CudaError> {
        let m = &self.manifest;
        let per_step: u64 = m
            .buffers
            .iter()
            .filter(|b| matches!(b.role, BufferRole::StagingInputs | BufferRole::CompletionRecords))
            .map(|b| b.byte_size)
            .sum();
        let len = (per_step as usize * 4).max(4 << 20);
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: out-pointer to a live local; the context is current.
        check("cuMemAllocHost", unsafe { cu::cuMemAllocHost_v2(&mut p, len) })?;
        self.pinned = p.cast();
        self.pinned_len = len;
        self.report.pinned_staging_bytes = len as u64;
        Ok(())
    }

    fn create_events(&mut self) -> Result<(), CudaError> {
        for i in 0..2 {
            // SAFETY: out-pointer to a field; flags 2 = CU_EVENT_DISABLE_TIMING.
            check("cuEventCreate", unsafe { cu::cuEventCreate(&mut self.half_left[i], 2) })?;
        }
        for i in 0..READ_EVENTS {
            let mut e = std::ptr::null_mut();
            // SAFETY: out-pointer to a live local.
            check("cuEventCreate", unsafe { cu::cuEventCreate(&mut e, 2) })?;
            self.read_events.push(e);
            self.free_read_events.push(i);
        }
        Ok(())
    }

    /// Copies a finished deferred read out of the ring, freeing its event.
    fn settle(&mut self, id: u64, wait: bool) -> Result<bool, CudaError> {
        let Some(DeferredRead::InFlight { event, at, len }) = self.reads.get(&id) else { return Ok(true) };
        let (event, at, len) = (*event, *at, *len);
        let e = self.read_events[event];
        // SAFETY: the event is live.
        let r = unsafe { cu::cuEventQuery(e) };
        if r == cu::CUresult::CUDA_ERROR_NOT_READY {
            if !wait {
                return Ok(false);
            }
            // SAFETY: the event is live.
            check("cuEventSynchronize", unsafe { cu::cuEventSynchronize(e) })?;
        } else {
            check("cuEventQuery", r)?;
        }
        // SAFETY: the copy into [at, at + len) of the ring completed (its event did).
        let bytes = unsafe { std::slice::from_raw_parts(self.pinned.add(at), len) }.to_vec();
        self.reads.insert(id, DeferredRead::Done(bytes));
        self.free_read_events.push(event);
        Ok(true)
    }

    /// Copies every deferred read lying in ring half `half` out of the ring.
    fn settle_half(&mut self, half: usize) -> Result<(), CudaError> {
        let half_len = self.pinned_len / 2;
        let ids: Vec<u64> = self
            .reads
            .iter()
            .filter(|(_, r)| matches!(r, DeferredRead::InFlight { at, .. } if at / half_len == half))
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            self.settle(id, true)?;
        }
        Ok(())
    }

    /// Enqueues a copy of a buffer range into the pinned ring, ordered after everything
    /// enqueued; `None` when the range does not fit in half the ring.
    pub fn read_later(&mut self, buffer: BufferId, offset: u64, len: u64) -> Result<Option<u64>, CudaError> {
        let addr = self.range(buffer, offset, len)?;
        if self.free_read_events.is_empty() {
            let ids: Vec<u64> = self.reads.keys().copied().collect();
            for id in ids {
                self.settle(id, true)?;
            }
        }
        let Some(p) = self.pinned_region(len as usize)? else { return Ok(None) };
        let Some(event) = self.free_read_events.pop() else { return Ok(None) };
        // SAFETY: p holds len bytes of the ring nobody reads until the event completes.
        check("cuMemcpyDtoHAsync", unsafe { cu::cuMemcpyDtoHAsync_v2(p.cast(), addr, len as usize, self.stream) })?;
        // SAFETY: event and stream are live.
        check("cuEventRecord", unsafe { cu::cuEventRecord(self.read_events[event], self.stream) })?;
        let id = self.next_read;
        self.next_read += 1;
        // SAFETY: p lies inside the ring allocation.
        let at = unsafe { p.offset_from(self.pinned) } as usize;
        self.reads.insert(id, DeferredRead::InFlight { event, at, len: len as usize });
        Ok(Some(id))
    }

    /// A deferred read's bytes once its copy landed; `None` while in flight unless `wait`.
    pub fn take_read(&mut self, id: u64, wait: bool) -> Result<Option<Vec<u8>>, CudaError> {
        if !self.reads.contains_key(&id) {
            return Err(CudaError::UnknownRead(id));
        }
        if !self.settle(id, wait)? {
            return Ok(None);
        }
        match self.reads.remove(&id) {
            Some(DeferredRead::Done(bytes)) => Ok(Some(bytes)),
            _ => Err(CudaError::UnknownRead(id)),
        }
    }

    /// Device memory in use now (all processes), from `cuMemGetInfo`.
    pub fn device_used_bytes(&self) -> Result<u64, CudaError> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: out-pointers to live locals; the context is current.
        check("cuMemGetInfo", unsafe { cu::cuMemGetInfo_v2(&mut free, &mut total) })?;
        Ok((total - free) as u64)
    }

    /// Growth of device memory in use since loading finished: 0 when nothing allocated after
    /// readiness (other processes on the device also count).
    pub fn device_growth_since_ready(&self) -> Result<i64, CudaError> {
        Ok(self.device_used_bytes()? as i64 - self.used_at_ready as i64)
    }

    /// A region of the pinned ring for `len` bytes (`None`: larger than half the ring). Moving
    /// to the other half waits until that half's earlier copies finished.
    fn pinned_region(&mut self, len: usize) -> Result<Option<*mut u8>, CudaError> {
        let half_len = self.pinned_len / 2;
        if len > half_len {
            return Ok(None);
        }
        let half = (self.pinned_at / half_len).min(1);
        if self.pinned_at + len > (half + 1) * half_len {
            // SAFETY: event and stream are live.
            check("cuEventRecord", unsafe { cu::cuEventRecord(self.half_left[half], self.stream) })?;
            self.half_recorded[half] = true;
            let next = 1 - half;
            if self.half_recorded[next] {
                // SAFETY: the event is live.
                check("cuEventSynchronize", unsafe { cu::cuEventSynchronize(self.half_left[next]) })?;
            }
            self.settle_half(next)?;
            self.pinned_at = next * half_len;
        }
        // SAFETY: pinned_at + len <= pinned_len, inside the allocation.
        let p = unsafe { self.pinned.add(self.pinned_at) };
        self.pinned_at += len.div_ceil(64) * 64;
        Ok(Some(p))
    }

    /// Stream-ordered write through the pinned ring: ordered before every later replay on the
    /// model stream without a synchronization.
    pub fn write_async(&mut self, buffer: BufferId, offset: u64, bytes: &[u8]) -> Result<(), CudaError> {
        let addr = self.range(buffer, offset, bytes.len() as u64)?;
        let Some(p) = self.pinned_region(bytes.len())? else { return self.write(buffer, offset, bytes) };
        // SAFETY: p holds bytes.len() bytes that no pending copy reads (see pinned_region).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len()) };
        // SAFETY: source is page-locked and stays valid until the stream drains; dest is mapped.
        check("cuMemcpyHtoDAsync", unsafe { cu::cuMemcpyHtoDAsync_v2(addr, p.cast(), bytes.len(), self.stream) })
    }

    /// Stream-ordered read after everything enqueued, through the pinned ring.
    pub fn read_ordered(&mut self, buffer: BufferId, offset: u64, len: u64) -> Result<Vec<u8>, CudaError> {
        let addr = self.range(buffer, offset, len)?;
        let Some(p) = self.pinned_region(len as usize)? else { return self.read(buffer, offset, len) };
        // SAFETY: p holds len bytes; the source range is mapped.
        check("cuMemcpyDtoHAsync", unsafe { cu::cuMemcpyDtoHAsync_v2(p.cast(), addr, len as usize, self.stream) })?;
        self.synchronize()?;
        // SAFETY: the copy into p completed with the synchronization.
        Ok(unsafe { std::slice::from_raw_parts(p, len as usize) }.to_vec())
    }

    /// Synchronous host-to-device write into a buffer (no allocation).
    ///
    /// From pageable memory `cuMemcpyHtoD` returns once the bytes are staged, not once they have
    /// landed, and the model stream is non-blocking (it does not order after the legacy stream
    /// the copy ran on): without the context synchronization a replay enqueued next can read the
    /// old contents (measured on the H200: a 1 MiB KV write raced the decode graph, 24,921 of
    /// 524,288 KV elements read as zero).
    pub fn write(&self, buffer: BufferId, offset: u64, bytes: &[u8]) -> Result<(), CudaError> {
        let addr = self.range(buffer, offset, bytes.len() as u64)?;
        self.synchronize()?;
        // SAFETY: the range is inside the buffer, hence the mapped arena.
        check("cuMemcpyHtoD", unsafe { cu::cuMemcpyHtoD_v2(addr, bytes.as_ptr().cast(), bytes.len()) })?;
        // SAFETY: the context is current.
        check("cuCtxSynchronize", unsafe { cu::cuCtxSynchronize() })
    }

    /// Synchronous device-to-host read of a buffer range.
    pub fn read(&self, buffer: BufferId, offset: u64, len: u64) -> Result<Vec<u8>, CudaError> {
        let addr = self.range(buffer, offset, len)?;
        self.synchronize()?;
        let mut out = vec![0u8; len as usize];
        // SAFETY: the destination holds `len` bytes; the source range is mapped.
        check("cuMemcpyDtoH", unsafe { cu::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), addr, out.len()) })?;
        Ok(out)
    }

    /// Writes the whole arena (tests and qualification).
    pub fn write_arena(&self, bytes: &[u8]) -> Result<(), CudaError> {
        if self.hole.is_some() {
            return Err(CudaError::PartiallyBacked("write_arena"));
        }
        let len = bytes.len().min(self.manifest.arena.byte_size as usize);
        self.synchronize()?;
        // SAFETY: len is within the mapped arena.
        check("cuMemcpyHtoD", unsafe { cu::cuMemcpyHtoD_v2(self.base, bytes.as_ptr().cast(), len) })?;
        // SAFETY: the context is current. See `write`.
        check("cuCtxSynchronize", unsafe { cu::cuCtxSynchronize() })
    }

    /// Reads the whole arena.
    pub fn read_arena(&self) -> Result<Vec<u8>, CudaError> {
        if self.hole.is_some() {
            return Err(CudaError::PartiallyBacked("read_arena"));
        }
        self.synchronize()?;
        let mut out = vec![0u8; self.manifest.arena.byte_size as usize];
        // SAFETY: the arena is mapped for at least byte_size bytes.
        check("cuMemcpyDtoH", unsafe { cu::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), self.base, out.len()) })?;
        Ok(out)
    }

    /// Enqueues one replay of `graph` on the model stream.
    pub fn replay(&self, graph: GraphId) -> Result<(), CudaError> {
        let g = self.graphs.get(&graph).ok_or(CudaError::UnknownGraph(graph.0))?;
        // SAFETY: exec and stream are live.
        check("cuGraphLaunch", unsafe { cu::cuGraphLaunch(g.exec, self.stream) })
    }

    /// Waits for everything enqueued.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        // SAFETY: the stream is live.
        check("cuStreamSynchronize", unsafe { cu::cuStreamSynchronize(self.stream) })
    }
}

impl crate::graph::GraphBackend for DeviceCore {
    fn write(&mut self, buffer: BufferId, offset: u64, bytes: &[u8]) -> Result<(), crate::ExecutorError> {
        Ok(self.write_async(buffer, offset, bytes)?)
    }

    fn read(&mut self, buffer: BufferId, offset: u64, len: u64) -> Result<Vec<u8>, crate::ExecutorError> {
        Ok(self.read_ordered(buffer, offset, len)?)
    }

    fn copy(&mut self, src: (BufferId, u64), dst: (BufferId, u64), len: u64) -> Result<(), crate::ExecutorError> {
        let from = self.range(src.0, src.1, len)?;
        let to = self.range(dst.0, dst.1, len)?;
        // SAFETY: both ranges lie in the mapped arena; ordered on the model stream.
        check("cuMemcpyDtoDAsync", unsafe { cu::cuMemcpyDtoDAsync_v2(to, from, len as usize, self.stream) })?;
        Ok(())
    }

    fn replay(&mut self, graph: GraphId) -> Result<(), crate::ExecutorError> {
        Ok(DeviceCore::replay(self, graph)?)
    }

    fn read_later(
        &mut self,
        buffer: BufferId,
        offset: u64,
        len: u64,
    ) -> Result<Option<crate::graph::ReadTicket>, crate::ExecutorError> {
        Ok(DeviceCore::read_later(self, buffer, offset, len)?.map(crate::graph::ReadTicket))
    }

    fn take_read(
        &mut self,
        ticket: crate::graph::ReadTicket,
        wait: bool,
    ) -> Result<Option<Vec<u8>>, crate::ExecutorError> {
        Ok(DeviceCore::take_read(self, ticket.0, wait)?)
    }

    fn device_memory_growth_bytes(&mut self) -> Option<i64> {
        self.device_growth_since_ready().ok()
    }

    fn kv_pages(&self) -> Option<u32> {
        Some(self.report.kv_pages)
    }

    fn attach_host_arena(
        &mut self,
        arena: std::sync::Arc<helios_offload::HostArena>,
    ) -> Result<(), crate::ExecutorError> {
        Ok(DeviceCore::attach_host_arena(self, arena)?)
    }

    fn unified_memory(&self) -> bool {
        // A device whose kind cannot be read is treated as discrete: the host tier stays on.
        self.integrated().unwrap_or(false)
    }

    fn copy_to_host(
        &mut self,
        src: (BufferId, u64),
        dst: helios_offload::HostExtent,
    ) -> Result<(), crate::ExecutorError> {
        let from = self.range(src.0, src.1, dst.len)?;
        let to = self.host_ptr(dst)?;
        // SAFETY: a mapped device range and a registered host range of `dst.len` bytes; the
        // scheduler keeps the extent untouched until the step completes.
        check("cuMemcpyDtoHAsync", unsafe {
            cu::cuMemcpyDtoHAsync_v2(to.cast(), from, dst.len as usize, self.stream)
        })?;
        Ok(())
    }

    fn copy_from_host(
        &mut self,
        src: helios_offload::HostExtent,
        dst: (BufferId, u64),
    ) -> Result<(), crate::ExecutorError> {
        let from = self.host_ptr(src)?;
        let to = self.range(dst.0, dst.1, src.len)?;
        let [order, _] = self.transfer_events;
        // SAFETY: live events and streams; the copy waits for the model stream's work so far
        // (a copy-out that filled the extent), and `end_step` makes later replays wait for it.
        unsafe {
            check("cuEventRecord", cu::cuEventRecord(order, self.stream))?;
            check("cuStreamWaitEvent", cu::cuStreamWaitEvent(self.copy_stream, order, 0))?;
            check("cuMemcpyHtoDAsync", cu::cuMemcpyHtoDAsync_v2(to, from.cast(), src.len as usize, self.copy_stream))?;
        }
        self.copies_pending = true;
        Ok(())
    }

    fn end_step(&mut self) -> Result<(), crate::ExecutorError> {
        if !std::mem::take(&mut self.copies_pending) {
            return Ok(());
        }
        let [_, done] = self.transfer_events;
        // SAFETY: live event and streams.
        unsafe {
            check("cuEventRecord", cu::cuEventRecord(done, self.copy_stream))?;
            check("cuStreamWaitEvent", cu::cuStreamWaitEvent(self.stream, done, 0))?;
        }
        Ok(())
    }
}

fn set_launch_attribute(node: cu::CUgraphNode, a: &LaunchAttribute) -> Result<(), CudaError> {
    // SAFETY: a zeroed union is valid; one field is set below.
    let mut v: cu::CUkernelNodeAttrValue = unsafe { std::mem::zeroed() };
    let id = match a {
        LaunchAttribute::Priority(p) => {
            v.priority = *p;
            cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PRIORITY
        }
        LaunchAttribute::ClusterDim(d) => {
            v.clusterDim.x = d.x;
            v.clusterDim.y = d.y;
            v.clusterDim.z = d.z;
            cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        }
        LaunchAttribute::Cooperative(c) => {
            v.cooperative = i32::from(*c);
            cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE
        }
        _ => return Err(CudaError::Kernel { kernel: 0, reason: "unsupported launch attribute" }),
    };
    // SAFETY: node is a live kernel node; v matches id.
    check("cuGraphKernelNodeSetAttribute", unsafe { cu::cuGraphKernelNodeSetAttribute(node, id, &v) })
}

/// The driver's data for an edge of `dependency`: a programmatic edge leaves `from` at its
/// programmatic or launch-order port; every edge enters `to` at its default port.
fn edge_data(dependency: Dependency) -> cu::CUgraphEdgeData {
    use cu::CUgraphDependencyType::{CU_GRAPH_DEPENDENCY_TYPE_DEFAULT, CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC};
    let (from_port, type_) = match dependency {
        Dependency::Full => (cu::CU_GRAPH_KERNEL_NODE_PORT_DEFAULT, CU_GRAPH_DEPENDENCY_TYPE_DEFAULT),
        Dependency::Programmatic => (cu::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC, CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC),
        Dependency::LaunchOrder => (cu::CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER, CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC),
    };
    cu::CUgraphEdgeData {
        from_port: from_port as u8,
        to_port: cu::CU_GRAPH_KERNEL_NODE_PORT_DEFAULT as u8,
        type_: type_ as u8,
        reserved: [0; 5],
    }
}

/// Whether the loaded driver exports `cuGraphAddDependencies_v2` (CUDA 12.3 and later). cudarc
/// resolves a symbol on first call and panics when it is missing, so look before calling.
fn has_edge_data_api() -> bool {
    // SAFETY: the driver library is loaded (init_driver ran before any graph is built); looking
    // a symbol up calls nothing.
    unsafe { cu::culib().get::<unsafe extern "C" fn()>(c"cuGraphAddDependencies_v2").is_ok() }
}

/// Adds `g`'s programmatic and launch-order edges between the nodes built in `handles`.
fn add_programmatic_edges(g: &Graph, graph: cu::CUgraph, handles: &[cu::CUgraphNode]) -> Result<(), CudaError> {
    let mut edges = g.programmatic_edges().peekable();
    if edges.peek().is_none() {
        return Ok(());
    }
    if !has_edge_data_api() {
        return Err(CudaError::ProgrammaticEdgesUnsupported { graph: g.id.0 });
    }
    for &Edge { from, to, dependency } in edges {
        let (from, to) = (handles[from], handles[to]);
        let data = edge_data(dependency);
        // SAFETY: both nodes are live kernel nodes of `graph` (validated); one edge, whose data
        // outlives the call.
        check("cuGraphAddDependencies_v2", unsafe { cu::cuGraphAddDependencies_v2(graph, &from, &to, &data, 1) })?;
    }
    Ok(())
}

fn destroy_graph(g: &DeviceGraph) {
    // SAFETY: handles are live or null; destroy functions accept each once.
    unsafe {
        if !g.exec.is_null() {
            cu::cuGraphExecDestroy(g.exec);
        }
        if !g.graph.is_null() {
            cu::cuGraphDestroy(g.graph);
        }
        for &e in &g.events {
            cu::cuEventDestroy_v2(e);
        }
    }
}

/// Node indices in dependency order over every edge (programmatic ones included); `None` for a
/// cycle.
fn topological(g: &Graph) -> Option<Vec<usize>> {
    let n = g.nodes.len();
    let mut indegree = vec![0usize; n];
    for e in &g.edges {
        *indegree.get_mut(e.to)? += 1;
    }
    let mut ready: Vec<usize> = (0..n).filter(|&i| indegree[i] == 0).collect();
    let mut out = Vec::with_capacity(n);
    while let Some(i) = ready.pop() {
        out.push(i);
        for e in g.edges.iter().filter(|e| e.from == i) {
            indegree[e.to] -= 1;
            if indegree[e.to] == 0 {
                ready.push(e.to);
            }
        }
    }
    (out.len() == n).then_some(out)
}

impl Drop for DeviceCore {
    fn drop(&mut self) {
        self.detach_host_arena();
        // Drain first: nothing may be destroyed while a replay can still touch it.
        // SAFETY: every handle below was created by this object and is destroyed once.
        unsafe {
            for stream in [self.stream, self.copy_stream] {
                if !stream.is_null() {
                    cu::cuStreamSynchronize(stream);
                }
            }
            for g in self.graphs.values() {
                destroy_graph(g);
            }
            for &m in &self.modules {
                cu::cuModuleUnload(m);
            }
            if self.reserved > 0 {
                for &(start, len, h) in &self.mappings {
                    cu::cuMemUnmap(self.base + start, len);
                    cu::cuMemRelease(h);
                }
                cu::cuMemAddressFree(self.base, self.reserved);
            }
            for &e in self.read_events.iter().chain(self.half_left.iter()).chain(self.transfer_events.iter()) {
                if !e.is_null() {
                    cu::cuEventDestroy_v2(e);
                }
            }
            if !self.stream.is_null() {
                cu::cuStreamDestroy_v2(self.stream);
            }
            if !self.copy_stream.is_null() {
                cu::cuStreamDestroy_v2(self.copy_stream);
            }
            if !self.pinned.is_null() {
                cu::cuMemFreeHost(self.pinned.cast());
            }
            if !self.context.is_null() {
                cu::cuDevicePrimaryCtxRelease_v2(self.device);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_absence_is_a_typed_error() {
        // On machines without libcuda this must be NoDriver, never a panic.
        match init_driver() {
            Ok(v) => assert!(v >= MIN_DRIVER_VERSION),
            Err(e) => {
                assert!(matches!(e, CudaError::NoDriver | CudaError::Call { .. } | CudaError::DriverTooOld { .. }))
            }
        }
    }

    #[test]
    fn auto_upload_stages_only_large_payloads() {
        assert_eq!(UploadPath::Auto.for_payload(262 << 20), UploadPath::Direct);
        assert_eq!(UploadPath::Auto.for_payload(STAGED_UPLOAD_MIN_BYTES - 1), UploadPath::Direct);
        assert_eq!(UploadPath::Auto.for_payload(STAGED_UPLOAD_MIN_BYTES), UploadPath::Staged);
        assert_eq!(UploadPath::Auto.for_payload(2050 << 20), UploadPath::Staged);
        // An explicit choice stands whatever the size.
        assert_eq!(UploadPath::Staged.for_payload(4096), UploadPath::Staged);
        assert_eq!(UploadPath::Direct.for_payload(u64::MAX), UploadPath::Direct);
    }

    #[test]
    fn slot_ranges_cover_each_byte_once_in_order() {
        for (len, slot) in [(0, 8), (1, 8), (8, 8), (9, 8), (100, 7), (64, 64), (65, 64)] {
            let ranges: Vec<_> = slot_ranges(len, slot).collect();
            let mut at = 0;
            for r in &ranges {
                assert_eq!(r.start, at, "len {len} slot {slot}: {ranges:?}");
                assert!(!r.is_empty() && r.len() <= slot);
                at = r.end;
            }
            assert_eq!(at, len);
        }
    }

    #[test]
    fn parallel_copy_is_a_copy() {
        for len in [0usize, 1, (1 << 20) - 3, 5 << 20, (9 << 20) + 11] {
            let src: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4093) as u8).collect();
            let mut dst = vec![0u8; len];
            parallel_copy(&mut dst, &src, 4);
            assert!(dst == src, "len {len}");
        }
    }

    static HOOK_CALLS: std::sync::Mutex<Vec<(u64, bool)>> = std::sync::Mutex::new(Vec::new());

    fn record(p: UploadProgress) {
        HOOK_CALLS.lock().expect("lock").push((p.staged_bytes, p.done));
    }

    #[test]
    fn progress_reports_each_tenth_once_and_the_end() {
        let mut meter = ProgressMeter::new(Some(record), 1000);
        // 25-byte steps: tenths are crossed at 100, 200, ... 900; nothing for 1000 until finish.
        for _ in 0..40 {
            meter.staged(25);
        }
        meter.finish();
        let calls = HOOK_CALLS.lock().expect("lock").clone();
        let expected: Vec<(u64, bool)> = (1..10).map(|t| (t * 100, false)).chain([(1000, true)]).collect();
        assert_eq!(calls, expected);
        // One large step crossing several tenths reports once.
        HOOK_CALLS.lock().expect("lock").clear();
        let mut meter = ProgressMeter::new(Some(record), 10);
        meter.staged(10);
        meter.finish();
        assert_eq!(*HOOK_CALLS.lock().expect("lock"), vec![(10, false), (10, true)]);
    }

    #[test]
    fn topological_order_respects_edges() {
        let fixture = helios_contract::fixtures::Fixture::build(&helios_contract::fixtures::FixtureSpec::default());
        let m = helios_contract::validate(&fixture.manifest).expect("valid");
        for g in &m.graphs {
            let order = topological(g).expect("acyclic");
            let pos: HashMap<usize, usize> = order.iter().enumerate().map(|(p, &i)| (i, p)).collect();
            for e in &g.edges {
                assert!(pos[&e.from] < pos[&e.to]);
            }
        }
        // The default fixture's programmatic edges count: they order nodes too.
        assert!(m.graphs.iter().any(|g| g.programmatic_edges().count() > 0));
    }

    #[test]
    fn programmatic_edges_leave_from_their_port() {
        let programmatic = edge_data(Dependency::Programmatic);
        assert_eq!(u32::from(programmatic.from_port), cu::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC);
        let launch_order = edge_data(Dependency::LaunchOrder);
        assert_eq!(u32::from(launch_order.from_port), cu::CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER);
        for data in [programmatic, launch_order] {
            assert_eq!(u32::from(data.to_port), cu::CU_GRAPH_KERNEL_NODE_PORT_DEFAULT);
            assert_eq!(data.type_, cu::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8);
            assert_eq!(data.reserved, [0; 5]);
        }
        // A full dependency is the driver's default edge: all zero.
        let full = edge_data(Dependency::Full);
        assert_eq!((full.from_port, full.to_port, full.type_, full.reserved), (0, 0, 0, [0; 5]));
    }
}
