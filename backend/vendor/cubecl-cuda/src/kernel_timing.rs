//! rcoa patch: the GPU time of every kernel launched, measured by a pair of
//! CUDA events recorded on the launch's stream around it (`Command::kernel`).
//!
//! Off unless [`start`] was called. CubeCL's own profiler (its `profiling`
//! log level) synchronizes the stream before and after every kernel and
//! times the host's wait, so small kernels read as the round trip and the
//! step runs serially; events leave the stream asynchronous and time the
//! kernel on the GPU. [`take`] hands out what was timed since the last call,
//! once the work is finished (after a device sync, or it waits for it).
//!
//! Process-wide: kernels of every stream and device are timed together, so
//! a caller that wants one rank's kernels runs one rank.

use cudarc::driver::result::{ctx, event};
use cudarc::driver::sys::{CUctx_st, CUevent, CUevent_flags, CUstream};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// One kernel launch's GPU time.
#[derive(Clone, Debug)]
pub struct KernelTime {
    /// The kernel's type name (`KernelMetadata::name`): the same for every
    /// launch of one kernel, whatever its shapes.
    pub name: &'static str,
    pub seconds: f64,
}

struct Timed {
    name: &'static str,
    context: *mut CUctx_st,
    start: CUevent,
    end: CUevent,
}

#[derive(Default)]
struct State {
    timed: Vec<Timed>,
    /// Events of launches already handed out, for reuse (creating one is a
    /// driver call per launch otherwise).
    free: Vec<(*mut CUctx_st, CUevent)>,
    /// The first failure to create or record an event since the last `take`.
    error: Option<String>,
}

// SAFETY: the raw handles are only used under the mutex, with their context
// made current first; CUDA events and contexts may be used from any thread.
unsafe impl Send for State {}

static ON: AtomicBool = AtomicBool::new(false);
static STATE: Mutex<Option<State>> = Mutex::new(None);

/// Time every kernel launched from now on.
pub fn start() {
    STATE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(State::default);
    ON.store(true, Ordering::Release);
}

pub(crate) fn on() -> bool {
    ON.load(Ordering::Acquire)
}

fn event_for(state: &mut State, context: *mut CUctx_st) -> Option<CUevent> {
    if let Some(i) = state.free.iter().rposition(|(c, _)| *c == context) {
        return Some(state.free.swap_remove(i).1);
    }
    match event::create(CUevent_flags::CU_EVENT_DEFAULT) {
        Ok(e) => Some(e),
        Err(e) => {
            state
                .error
                .get_or_insert_with(|| format!("cuEventCreate: {e:?}"));
            None
        }
    }
}

fn record(state: &mut State, e: CUevent, stream: CUstream) -> bool {
    // SAFETY: `e` was created in the stream's context (the caller's current
    // one) and is not destroyed while timed.
    match unsafe { event::record(e, stream) } {
        Ok(()) => true,
        Err(err) => {
            state
                .error
                .get_or_insert_with(|| format!("cuEventRecord: {err:?}"));
            false
        }
    }
}

/// Before a launch on `stream`, whose context is current on this thread:
/// the start event, recorded (None when timing is off or failed).
pub(crate) fn before_launch(context: *mut CUctx_st, stream: CUstream) -> Option<CUevent> {
    let mut guard = STATE.lock().unwrap_or_else(|e| e.into_inner());
    let state = guard.as_mut()?;
    let e = event_for(state, context)?;
    if record(state, e, stream) {
        Some(e)
    } else {
        state.free.push((context, e));
        None
    }
}

/// After the launch of `name` that `before_launch` started with `start`.
pub(crate) fn after_launch(
    name: &'static str,
    context: *mut CUctx_st,
    stream: CUstream,
    start: CUevent,
) {
    let mut guard = STATE.lock().unwrap_or_else(|e| e.into_inner());
    let Some(state) = guard.as_mut() else {
        return;
    };
    let Some(end) = event_for(state, context) else {
        state.free.push((context, start));
        return;
    };
    if record(state, end, stream) {
        state.timed.push(Timed {
            name,
            context,
            start,
            end,
        });
    } else {
        state.free.extend([(context, start), (context, end)]);
    }
}

/// rcoa patch: times work queued outside CubeCL on `stream` (a cuBLAS
/// call) as one launch named `name`, as `Command::kernel` times its kernels.
/// The stream's context must be current on this thread.
pub fn time_external<T>(name: &'static str, stream: CUstream, f: impl FnOnce() -> T) -> T {
    let context = match on().then(ctx::get_current) {
        Some(Ok(Some(context))) => context,
        _ => return f(),
    };
    let start = before_launch(context, stream);
    let out = f();
    if let Some(start) = start {
        after_launch(name, context, stream, start);
    }
    out
}

/// The kernels timed since the last call, in launch order. Waits for each to
/// finish. An error names the first event CUDA refused; the launches it
/// concerned are missing from the result, so it is returned instead.
pub fn take() -> Result<Vec<KernelTime>, String> {
    let mut guard = STATE.lock().unwrap_or_else(|e| e.into_inner());
    let Some(state) = guard.as_mut() else {
        return Ok(Vec::new());
    };
    let timed = std::mem::take(&mut state.timed);
    let mut out = Vec::with_capacity(timed.len());
    let mut error = state.error.take();
    let mut current = std::ptr::null_mut();
    for t in timed {
        if t.context != current {
            // SAFETY: the context created the events and outlives them (the
            // device's primary context, held by CubeCL for the process).
            if let Err(e) = unsafe { ctx::set_current(t.context) } {
                error.get_or_insert_with(|| format!("cuCtxSetCurrent: {e:?}"));
            }
            current = t.context;
        }
        // SAFETY: both events were created and recorded on one stream, in
        // `t.context`, and are not destroyed.
        match unsafe { event::synchronize(t.end).and_then(|()| event::elapsed(t.start, t.end)) } {
            Ok(ms) => out.push(KernelTime {
                name: t.name,
                seconds: ms as f64 / 1e3,
            }),
            Err(e) => {
                error.get_or_insert_with(|| format!("timing `{}`: {e:?}", t.name));
            }
        }
        state
            .free
            .extend([(t.context, t.start), (t.context, t.end)]);
    }
    match error {
        Some(e) => Err(e),
        None => Ok(out),
    }
}
