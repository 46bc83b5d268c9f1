//! One value per thread and per pool: the home of the pool's thread caches.
//!
//! Like the `thread_local` crate's `ThreadLocal`, with one difference the pool needs: a thread
//! whose thread-locals are being destroyed (a buffer dropped from a user's `thread_local!` at
//! thread exit) gets `None` instead of a panic, and the pool serves it from its shared lists.
//!
//! Each thread draws a small index, reused after it exits; a pool keeps its values in buckets
//! of 1, 2, 4, … entries by index, so a lookup is a thread-local read and two loads. A value
//! outlives its thread: the next thread to draw the index inherits it (for the pool, a cache
//! of idle blocks that stays useful).

use std::cell::{Cell, UnsafeCell};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::mem::MaybeUninit;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

use parking_lot::Mutex;

/// Indices of threads that have exited, smallest first, and the next fresh one.
struct Indices {
    next: usize,
    free: BinaryHeap<Reverse<usize>>,
}

static INDICES: Mutex<Indices> = Mutex::new(Indices {
    next: 0,
    free: BinaryHeap::new(),
});

/// This thread has not drawn an index yet.
const UNSET: usize = usize::MAX;
/// This thread has given its index back: its thread-locals are being destroyed.
const GONE: usize = usize::MAX - 1;

thread_local! {
    /// This thread's index, `UNSET` or `GONE`. Without a destructor, so readable at any time.
    static INDEX: Cell<usize> = const { Cell::new(UNSET) };
    /// Gives the index back when the thread's thread-locals are destroyed.
    static RETURN_INDEX: IndexGuard = const { IndexGuard };
}

struct IndexGuard;

impl Drop for IndexGuard {
    fn drop(&mut self) {
        let index = INDEX.replace(GONE);
        if index < GONE {
            // Through the lock, the next owner of the index sees this thread's last use of
            // its values happen before its own first use.
            INDICES.lock().free.push(Reverse(index));
        }
    }
}

/// This thread's index; `None` once its thread-locals are being destroyed.
#[inline]
fn current() -> Option<usize> {
    let index = INDEX.get();
    if index < GONE {
        Some(index)
    } else if index == UNSET {
        draw()
    } else {
        None
    }
}

#[cold]
fn draw() -> Option<usize> {
    // The guard cannot be set up once the thread's thread-locals are being destroyed.
    RETURN_INDEX.try_with(|_| ()).ok()?;
    let index = {
        let mut indices = INDICES.lock();
        match indices.free.pop() {
            Some(Reverse(index)) => index,
            None => {
                indices.next += 1;
                indices.next - 1
            }
        }
    };
    INDEX.set(index);
    Some(index)
}

/// Bucket `b` holds the entries of indices `2^b - 1 .. 2^(b+1) - 1`.
const BUCKETS: usize = usize::BITS as usize;

#[inline]
fn locate(index: usize) -> (usize, usize) {
    let bucket = (usize::BITS - 1 - (index + 1).leading_zeros()) as usize;
    (bucket, index + 1 - (1 << bucket))
}

struct Entry<T> {
    present: AtomicBool,
    value: UnsafeCell<MaybeUninit<T>>,
}

/// One `T` per thread (see the module documentation).
pub(crate) struct PerThread<T> {
    buckets: [AtomicPtr<Entry<T>>; BUCKETS],
}

// SAFETY: the values are created on their threads and then shared; `T: Send` lets a value
// created on one thread be used, and dropped, on another.
unsafe impl<T: Send> Send for PerThread<T> {}
// SAFETY: `&PerThread` hands out `&T` to any thread (`iter`), so `T: Sync`; and a value may
// be inherited by another thread, so `T: Send`.
unsafe impl<T: Send + Sync> Sync for PerThread<T> {}

impl<T: Send + Sync> PerThread<T> {
    pub(crate) fn new() -> Self {
        Self {
            buckets: [const { AtomicPtr::new(ptr::null_mut()) }; BUCKETS],
        }
    }

    /// This thread's value, created by `create` on first use; `None` while the thread's
    /// thread-locals are being destroyed.
    #[inline]
    pub(crate) fn get_or(&self, create: impl FnOnce() -> T) -> Option<&T> {
        let index = current()?;
        match self.lookup(index) {
            Some(value) => Some(value),
            None => Some(self.insert(index, create())),
        }
    }

    /// This thread's value, if it has one.
    #[inline]
    pub(crate) fn get(&self) -> Option<&T> {
        let index = INDEX.get();
        if index < GONE {
            self.lookup(index)
        } else {
            None
        }
    }

    #[inline]
    fn lookup(&self, index: usize) -> Option<&T> {
        let (bucket, offset) = locate(index);
        let entries = self.buckets[bucket].load(Ordering::Acquire);
        if entries.is_null() {
            return None;
        }
        // SAFETY: a non-null bucket holds `1 << bucket` entries, live until `self` drops.
        let entry = unsafe { &*entries.add(offset) };
        let present = entry.present.load(Ordering::Acquire);
        // SAFETY: `present` is set (with release) only after the value is written, and the
        // value is never written again nor dropped before `self`.
        present.then(|| unsafe { (*entry.value.get()).assume_init_ref() })
    }

    /// Stores `value` as the value of `index`, held by this thread.
    #[cold]
    fn insert(&self, index: usize, value: T) -> &T {
        let (bucket, offset) = locate(index);
        let slot = &self.buckets[bucket];
        let mut entries = slot.load(Ordering::Acquire);
        if entries.is_null() {
            let fresh: Box<[Entry<T>]> = (0..1usize << bucket)
                .map(|_| Entry {
                    present: AtomicBool::new(false),
                    value: UnsafeCell::new(MaybeUninit::uninit()),
                })
                .collect();
            let fresh = Box::into_raw(fresh).cast::<Entry<T>>();
            entries = match slot.compare_exchange(
                ptr::null_mut(),
                fresh,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => fresh,
                Err(theirs) => {
                    // SAFETY: `fresh` was never shared; it is freed as it was made.
                    drop(unsafe {
                        Box::from_raw(ptr::slice_from_raw_parts_mut(fresh, 1 << bucket))
                    });
                    theirs
                }
            };
        }
        // SAFETY: the bucket holds `1 << bucket` entries; only the thread holding `index`
        // writes its entry, and the entry has no value yet (the caller found none), so no
        // reader looks at it until `present` is set.
        // The reference returned is derived from the cell's raw pointer, as `lookup`'s are,
        // not from the `&mut` the write goes through: other threads write the value's atomics
        // (a pause), which would invalidate a reference derived from a unique one.
        unsafe {
            let entry = &*entries.add(offset);
            (*entry.value.get()).write(value);
            entry.present.store(true, Ordering::Release);
            (*entry.value.get()).assume_init_ref()
        }
    }

    /// Every value, of live threads and of threads that have exited.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.buckets
            .iter()
            .enumerate()
            .flat_map(|(bucket, slot)| {
                let entries = slot.load(Ordering::Acquire);
                let len = if entries.is_null() { 0 } else { 1 << bucket };
                // SAFETY: a non-null bucket holds `len` entries, live until `self` drops.
                (0..len).map(move |offset| unsafe { &*entries.add(offset) })
            })
            .filter(|entry| entry.present.load(Ordering::Acquire))
            // SAFETY: present entries hold a value (see `lookup`).
            .map(|entry| unsafe { (*entry.value.get()).assume_init_ref() })
    }

    /// Every value, with exclusive access.
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.buckets
            .iter_mut()
            .enumerate()
            .flat_map(|(bucket, slot)| {
                let entries = *slot.get_mut();
                let len = if entries.is_null() { 0 } else { 1 << bucket };
                // SAFETY: a non-null bucket holds `len` entries; `&mut self` makes each
                // reference unique.
                (0..len).map(move |offset| unsafe { &mut *entries.add(offset) })
            })
            .filter_map(|entry| {
                let present = *entry.present.get_mut();
                // SAFETY: present entries hold a value.
                present.then(|| unsafe { entry.value.get_mut().assume_init_mut() })
            })
    }
}

impl<T> Drop for PerThread<T> {
    fn drop(&mut self) {
        for (bucket, slot) in self.buckets.iter_mut().enumerate() {
            let entries = *slot.get_mut();
            if entries.is_null() {
                continue;
            }
            // SAFETY: made by `insert` as a boxed slice of `1 << bucket` entries, freed once.
            let mut entries =
                unsafe { Box::from_raw(ptr::slice_from_raw_parts_mut(entries, 1 << bucket)) };
            for entry in entries.iter_mut() {
                if *entry.present.get_mut() {
                    // SAFETY: a present entry holds a value, dropped once, here.
                    unsafe { entry.value.get_mut().assume_init_drop() };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    #[test]
    fn indices_map_to_buckets_without_gaps() {
        assert_eq!(locate(0), (0, 0));
        assert_eq!(locate(1), (1, 0));
        assert_eq!(locate(2), (1, 1));
        assert_eq!(locate(3), (2, 0));
        assert_eq!(locate(6), (2, 3));
        assert_eq!(locate(7), (3, 0));
        assert_eq!(locate(usize::MAX - 2).0, BUCKETS - 1);
    }

    #[test]
    fn each_thread_keeps_one_value_and_iter_sees_all() {
        let mut values = PerThread::new();
        let barrier = std::sync::Barrier::new(4);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                let (values, barrier) = (&values, &barrier);
                scope.spawn(move || {
                    let mine = values.get_or(|| AtomicUsize::new(0)).unwrap();
                    // All four live at once, so none inherits another's value.
                    barrier.wait();
                    assert_eq!(mine.fetch_add(1, Ordering::Relaxed), 0);
                    assert!(ptr::eq(values.get().unwrap(), mine));
                    assert!(ptr::eq(values.get_or(|| unreachable!()).unwrap(), mine));
                });
            }
        });
        let seen: Vec<_> = values.iter().map(|v| v.load(Ordering::Relaxed)).collect();
        assert_eq!(seen, [1; 4]);
        // A later thread inherits one of the four, or (if it starts before they have given
        // their indices back) has one of its own.
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let value = values.get_or(|| AtomicUsize::new(0)).unwrap();
                value.fetch_add(1, Ordering::Relaxed)
            });
        });
        let total: usize = values.iter_mut().map(|v| *v.get_mut()).sum();
        assert_eq!(total, 5);
    }

    #[test]
    fn a_thread_whose_thread_locals_are_going_gets_none() {
        struct Probe(
            std::sync::Arc<PerThread<u32>>,
            std::sync::mpsc::Sender<bool>,
        );
        impl Drop for Probe {
            fn drop(&mut self) {
                let _ = self.1.send(self.0.get_or(|| 7).is_none());
            }
        }
        thread_local! {
            static PROBE: std::cell::RefCell<Option<Probe>> = const { std::cell::RefCell::new(None) };
        }
        let values = std::sync::Arc::new(PerThread::new());
        let (tx, rx) = std::sync::mpsc::channel();
        let worker_values = values.clone();
        std::thread::spawn(move || {
            // Registered first, so destroyed after the index guard set up by `get_or`.
            PROBE.with(|p| drop(p.borrow()));
            assert_eq!(*worker_values.get_or(|| 1).unwrap(), 1);
            PROBE.with(|p| *p.borrow_mut() = Some(Probe(worker_values, tx)));
        })
        .join()
        .unwrap();
        let got_none = rx.recv().expect("the probe ran without panicking");
        // glibc destroys thread-locals in the reverse order of their first use, so the probe
        // runs after the index is gone; elsewhere the order is unspecified.
        if cfg!(all(target_os = "linux", target_env = "gnu", not(miri))) {
            assert!(got_none, "an exiting thread was given a value");
        }
    }
}
