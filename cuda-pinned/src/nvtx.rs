//! NVTX ranges (the `nvtx` feature): this crate's spans, and the spans of the other crates of
//! the program, on the CUDA timeline of Nsight Systems.
//!
//! [`NvtxLayer`] is a `tracing-subscriber` layer that opens an NVTX range when a span is entered
//! and closes it when the span is left, and marks each event. Nothing is linked at build time:
//! as NVTX's own header-only client does, the first range asks the environment for a tool
//! (`NVTX_INJECTION64_PATH`, which Nsight Systems sets for the programs it profiles), loads it,
//! and hands it the table of entry points it fills in. Without a tool every call returns at
//! once.
//!
//! ```no_run
//! use tracing_subscriber::layer::SubscriberExt;
//!
//! let subscriber = tracing_subscriber::registry().with(cuda_pinned::nvtx::NvtxLayer::new());
//! tracing::subscriber::set_global_default(subscriber)?;
//! // `nsys profile ./program` now shows the copies, pinning and waits as ranges.
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicPtr, AtomicU32, Ordering};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::registry::LookupSpan;

/// A layer that shows spans as NVTX ranges and events as NVTX marks.
///
/// A range is named after its span and fields (`copy direction=host to device bytes=1048576
/// …`). Ranges are pushed and popped on the thread that enters and leaves the span, as NVTX's
/// ranges are per thread.
#[derive(Clone, Copy, Debug, Default)]
pub struct NvtxLayer {
    _private: (),
}

impl NvtxLayer {
    /// The layer. The NVTX tool, if any, is loaded at the first range.
    pub fn new() -> Self {
        Self::default()
    }
}

/// A span's range name, kept in the span's extensions.
struct Label(CString);

impl<S> Layer<S> for NvtxLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attributes: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else {
            return;
        };
        let mut label = Fields(span.name().to_owned());
        attributes.record(&mut label);
        span.extensions_mut().insert(Label(c_string(label.0)));
    }

    fn on_enter(&self, id: &Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id)
            && let Some(label) = span.extensions().get::<Label>()
        {
            range_push(&label.0);
        }
    }

    fn on_exit(&self, id: &Id, ctx: Context<'_, S>) {
        if ctx
            .span(id)
            .is_some_and(|span| span.extensions().get::<Label>().is_some())
        {
            range_pop();
        }
    }

    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let mut label = Fields(String::new());
        event.record(&mut label);
        mark(&c_string(label.0));
    }
}

/// A span's or event's name and fields, as `name key=value …` (an event's `message` bare).
struct Fields(String);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if !self.0.is_empty() {
            self.0.push(' ');
        }
        if field.name() == "message" {
            let _ = write!(self.0, "{value:?}");
        } else {
            let _ = write!(self.0, "{}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.record_debug(field, &format_args!("{value}"));
    }
}

/// `text` as a C string, any NUL in it dropped.
fn c_string(text: String) -> CString {
    CString::new(text).unwrap_or_else(|error| {
        let mut bytes = error.into_vec();
        bytes.retain(|&b| b != 0);
        CString::new(bytes).expect("no NUL is left")
    })
}

/// Opens a range named `message` on this thread.
pub fn range_push(message: &CStr) {
    if let Some(push) = entry::<unsafe extern "C" fn(*const c_char) -> c_int>(CORE_RANGE_PUSH_A) {
        // SAFETY: the tool installed this entry point with NVTX's `nvtxRangePushA` signature;
        // the message is a NUL-terminated string that outlives the call.
        unsafe { push(message.as_ptr()) };
    }
}

/// Closes this thread's innermost range.
pub fn range_pop() {
    if let Some(pop) = entry::<unsafe extern "C" fn() -> c_int>(CORE_RANGE_POP) {
        // SAFETY: the tool installed this entry point with `nvtxRangePop`'s signature.
        unsafe { pop() };
    }
}

/// Marks an instant named `message`.
pub fn mark(message: &CStr) {
    if let Some(mark) = entry::<unsafe extern "C" fn(*const c_char)>(CORE_MARK_A) {
        // SAFETY: the tool installed this entry point with `nvtxMarkA`'s signature; the
        // message outlives the call.
        unsafe { mark(message.as_ptr()) };
    }
}

// NVTX's injection protocol (the `nvtxDetail` headers of NVTX 3): the tool's
// `InitializeInjectionNvtx2(getExportTable)` asks for the callbacks table, and through its
// `GetModuleFunctionTable` for each module's table of pointers to entry-point slots, which it
// fills in.

/// Callback ids of the core module: `nvtxMarkA`, `nvtxRangePushA`, `nvtxRangePop`.
const CORE_MARK_A: usize = 2;
const CORE_RANGE_PUSH_A: usize = 9;
const CORE_RANGE_POP: usize = 11;
/// Entries of each module's table (`NVTX_CBID_<MODULE>_SIZE`), by module id 1 to 6: core,
/// CUDA, OpenCL, CUDA runtime, core 2, sync.
const MODULE_SIZES: [usize; 6] = [16, 9, 15, 7, 16, 7];
/// The largest of them.
const MOST_SLOTS: usize = 16;
/// The export table ids: callbacks, version information.
const ETID_CALLBACKS: u32 = 1;
const ETID_VERSIONINFO: u32 = 3;
/// The NVTX version this client speaks.
const NVTX_VERSION: u32 = 3;

/// The entry points a tool may install, by module (index = module id - 1) and callback id.
/// A null slot is a call that does nothing.
static SLOTS: [[AtomicPtr<c_void>; MOST_SLOTS]; 6] =
    [const { [const { AtomicPtr::new(std::ptr::null_mut()) }; MOST_SLOTS] }; 6];

/// Whether the tool was looked for: not yet, under way, done.
static STATE: AtomicU32 = AtomicU32::new(FRESH);
const FRESH: u32 = 0;
const STARTED: u32 = 1;
const DONE: u32 = 2;

/// The core module's entry point `id`, once a tool was looked for; `None` without one.
fn entry<F: Copy>(id: usize) -> Option<F> {
    const { assert!(size_of::<F>() == size_of::<*mut c_void>()) };
    if STATE.load(Ordering::Acquire) != DONE {
        initialize();
    }
    let slot = SLOTS[0][id].load(Ordering::Acquire);
    // SAFETY: a non-null slot holds an entry point the tool installed for this callback id,
    // of the function pointer type `F` the caller names for it (checked to be pointer-sized).
    (!slot.is_null()).then(|| unsafe { std::mem::transmute_copy::<*mut c_void, F>(&slot) })
}

/// Looks for the tool once per process; other threads wait for the first. A call made on the
/// initialising thread by the tool itself finds the state started and does nothing.
fn initialize() {
    match STATE.compare_exchange(FRESH, STARTED, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => {
            load_tool();
            STATE.store(DONE, Ordering::Release);
        }
        Err(_) => {
            if INITIALIZING.get() {
                return;
            }
            while STATE.load(Ordering::Acquire) != DONE {
                std::thread::yield_now();
            }
        }
    }
}

thread_local! {
    /// Whether this thread is running the tool's initialisation.
    static INITIALIZING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Loads the tool `NVTX_INJECTION64_PATH` names and lets it fill the slots; whether it
/// attached. The library stays loaded for good once it has (its entry points are in the slots);
/// one that declines is unloaded, and what it wrote cleared.
fn load_tool() -> bool {
    let Some(path) = std::env::var_os("NVTX_INJECTION64_PATH").filter(|p| !p.is_empty()) else {
        return false;
    };
    let Ok(path) = CString::new(std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str())) else {
        return false;
    };
    // SAFETY: loading a library runs its initialisers: NVTX_INJECTION64_PATH names a tool
    // made to be loaded into any program so, as NVTX's own client does.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_LAZY) };
    if handle.is_null() {
        return false;
    }
    // SAFETY: a symbol looked up in the handle just opened.
    let init = unsafe { libc::dlsym(handle, c"InitializeInjectionNvtx2".as_ptr()) };
    if init.is_null() {
        // SAFETY: opened above, and nothing of it is in use.
        unsafe { libc::dlclose(handle) };
        return false;
    }
    type Init = unsafe extern "C" fn(extern "C" fn(u32) -> *const c_void) -> c_int;
    // SAFETY: `InitializeInjectionNvtx2` has this signature in NVTX's protocol.
    let init = unsafe { std::mem::transmute::<*mut c_void, Init>(init) };
    INITIALIZING.set(true);
    // SAFETY: the tool's entry point, given the export-table callback it expects.
    let status = unsafe { init(export_table) };
    INITIALIZING.set(false);
    if status == 0 {
        for module in &SLOTS {
            for slot in module {
                slot.store(std::ptr::null_mut(), Ordering::Relaxed);
            }
        }
        // SAFETY: no slot points into it any more.
        unsafe { libc::dlclose(handle) };
        return false;
    }
    true
}

/// `NvtxExportTableCallbacks`.
#[repr(C)]
struct Callbacks {
    struct_size: usize,
    get_module_function_table: extern "C" fn(
        module: c_int,
        table: *mut *const *const AtomicPtr<c_void>,
        size: *mut c_uint,
    ) -> c_int,
}

/// `NvtxExportTableVersionInfo`.
#[repr(C)]
struct VersionInfo {
    struct_size: usize,
    version: u32,
    reserved: u32,
    set_injection_version: extern "C" fn(u32),
}

static CALLBACKS: Callbacks = Callbacks {
    struct_size: size_of::<Callbacks>(),
    get_module_function_table,
};

static VERSION_INFO: VersionInfo = VersionInfo {
    struct_size: size_of::<VersionInfo>(),
    version: NVTX_VERSION,
    reserved: 0,
    set_injection_version,
};

/// A module's table: a null entry (callback id 0), a pointer to each slot, a null terminator.
struct Table([*const AtomicPtr<c_void>; MOST_SLOTS + 1]);

// SAFETY: the pointers are to statics (atomics), read by the tool only.
unsafe impl Sync for Table {}

static TABLES: [Table; 6] = {
    let mut tables = [const { Table([std::ptr::null(); MOST_SLOTS + 1]) }; 6];
    let mut module = 0;
    while module < 6 {
        let mut id = 1;
        while id < MODULE_SIZES[module] {
            tables[module].0[id] = &SLOTS[module][id];
            id += 1;
        }
        module += 1;
    }
    tables
};

/// `getExportTable`: the callbacks and version tables; null for any other id.
extern "C" fn export_table(id: u32) -> *const c_void {
    match id {
        ETID_CALLBACKS => std::ptr::from_ref(&CALLBACKS).cast(),
        ETID_VERSIONINFO => std::ptr::from_ref(&VERSION_INFO).cast(),
        _ => std::ptr::null(),
    }
}

/// `GetModuleFunctionTable`: module `module`'s table and its size, for modules 1 to 6.
extern "C" fn get_module_function_table(
    module: c_int,
    table: *mut *const *const AtomicPtr<c_void>,
    size: *mut c_uint,
) -> c_int {
    let Some(index) = usize::try_from(module)
        .ok()
        .and_then(|m| m.checked_sub(1))
        .filter(|&m| m < MODULE_SIZES.len())
    else {
        return 0;
    };
    if !table.is_null() {
        // SAFETY: the tool passed a place for the table's address.
        unsafe { table.write(TABLES[index].0.as_ptr()) };
    }
    if !size.is_null() {
        // SAFETY: the tool passed a place for the size.
        unsafe { size.write(MODULE_SIZES[index] as c_uint) };
    }
    1
}

/// `SetInjectionNvtxVersion`: nothing to do (NVTX ignores the value).
extern "C" fn set_injection_version(_version: u32) {}
