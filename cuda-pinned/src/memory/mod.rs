//! The kinds of page-locked memory: each kind is an allocator of its own under one contract
//! that names no kind, and the default picks one for the machine.
//!
//! | module | what | chosen |
//! |---|---|---|
//! | `allocator` | the [`PinnedAllocator`](crate::PinnedAllocator) contract behind every container, the [`Allocation`](crate::Allocation) it hands out, the [`MemoryKind`](crate::MemoryKind) each buffer reports, and [`PendingUses`](crate::PendingUses), the device work that may still use a buffer when it is dropped | by every kind and every container |
//! | `default` | [`DefaultPinned`](crate::DefaultPinned): the best kind this machine has, picked once per process | by containers unless told otherwise |
//! | `cuda_host` | kind 1, [`CudaHost`](crate::CudaHost): `cudaHostAlloc` with typed flags; simple, slow to get, and it holds the driver's lock meanwhile | by the default where the device cannot register memory; by hand for mapped or write-combined memory |
//! | `registered` | kind 2, [`Registered`](crate::Registered): memory this crate maps, backs with huge pages, pre-faults on several threads and registers with `cudaHostRegister`, optionally in chunks | by the default with CUDA: the fast path |
//! | `registration` | kind 3, [`Registration`](crate::Registration), [`ReadOnlyRegistration`](crate::ReadOnlyRegistration) and [`RegisteredVec`](crate::RegisteredVec): memory the caller already owns, registered in place | by hand, for data already in a slice or a `Vec` (read-only for a mapping of a file) |
//! | `host_locked` | kind 4, [`HostLocked`](crate::HostLocked): `mlock`ed memory that no GPU knows, so copies from it are staged like pageable ones | by the default without CUDA, so programs and their tests run on CPU-only machines |
//! | `virtual_host` | kind 5, [`VirtualHost`](crate::VirtualHost): host memory from CUDA's virtual-memory API on the GPU's NUMA node, in chunks mapped into one reserved range; never stalls other threads' copies and grows in place, but is slower to create | by hand (CUDA 12.5 or newer): memory made while other threads copy, vectors that grow, a pool's blocks pinned ahead |
//! | `flags` | [`HostAllocFlags`](crate::HostAllocFlags) and [`RegisterFlags`](crate::RegisterFlags): the flag words of `cudaHostAlloc` and `cudaHostRegister` | by `cuda_host`, `registered` and `registration` |
//! | `uses` | a buffer's record of the streams it was used on (`record_stream`), which holds its memory back until their work is done | by every container and registration |
//! | `chunks` | the record of buffers registered in chunks: CUDA refuses a copy that spans two registrations, so each copy this crate queues is split at their boundaries | by `registered` when it registers in chunks; looked up by every copy while such a buffer lives |

pub(crate) mod allocator;
pub(crate) mod chunks;
pub(crate) mod cuda_host;
pub(crate) mod default;
pub(crate) mod flags;
pub(crate) mod host_locked;
pub(crate) mod registered;
pub(crate) mod registration;
pub(crate) mod uses;
pub(crate) mod virtual_host;
