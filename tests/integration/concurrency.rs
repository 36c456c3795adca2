//! Concurrency under load (issue 46, item 5): one model called from many threads at once, each
//! thread in its own mode — plain calls, calls under hooks that change the output, functional
//! calls with their own tensors, and first calls of an unbuilt lazy model racing to build it —
//! for a bounded time. Every output must be exactly the one its mode gives on one thread, and
//! the whole run must finish (a watchdog turns a deadlock into a failure).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use module_runtime::nn::LazyLinear;
use module_runtime::prelude::*;
use module_runtime::HookOptions;

/// Threads per mode (four modes: 16 threads) and how long they call.
const THREADS_PER_MODE: usize = 4;
const RUN_FOR: Duration = Duration::from_millis(1500);

#[derive(Module)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Forward<&Tensor> for Mlp {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc2.call(&self.fc1.call(x)?.relu()?)
    }
}

#[derive(Module)]
struct LazyMlp {
    fc1: LazyLinear,
    fc2: LazyLinear,
}

impl Forward<&Tensor> for LazyMlp {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc2.call(&self.fc1.call(x)?.relu()?)
    }
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

/// Runs `f` on its own thread and fails if it has not finished within `limit`.
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(std::thread::spawn(f).join());
    });
    match rx.recv_timeout(limit) {
        Ok(Ok(v)) => v,
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => panic!("not finished after {limit:?}: a deadlock"),
    }
}

#[test]
fn many_threads_in_every_mode_get_exact_outputs_and_finish() {
    let calls = within(Duration::from_secs(120), run);
    eprintln!(
        "{} threads for {RUN_FOR:?}: {calls:?} calls (plain, hooked, functional, lazy)",
        4 * THREADS_PER_MODE
    );
    assert!(calls.iter().all(|&n| n >= THREADS_PER_MODE), "{calls:?}");
}

fn run() -> [usize; 4] {
    let dev = Device::Cpu;
    let model = Arc::new(Mlp {
        fc1: Linear::new(32, 64, &dev).unwrap(),
        fc2: Linear::new(64, 16, &dev).unwrap(),
    });
    let x = Tensor::randn(0f32, 1., (8, 32), &dev).unwrap();
    let plain = values(&model.call(&x).unwrap());

    // Hooks that double fc2's output, for the hooked threads only.
    let hooks = Hooks::new();
    let fired = Arc::new(AtomicUsize::new(0));
    let count = fired.clone();
    hooks
        .register_forward_hook(
            "fc2",
            move |_, _, out| {
                count.fetch_add(1, Ordering::Relaxed);
                Ok(Some(vec![(&out[0] * 2.0)?]))
            },
            HookOptions::default(),
        )
        .unwrap();
    let hooked: Vec<f32> = plain.iter().map(|v| v * 2.0).collect();

    // Other tensors for every parameter, for the functional threads.
    let mut other = StateDict::new();
    for (name, p) in model.named_parameters() {
        other.insert(name, (p.tensor().unwrap() * -0.5).unwrap());
    }
    let substituted = values(&model.functional_call(&other, &x).unwrap());
    assert_ne!(substituted, plain);

    // An unbuilt model whose first calls race.
    let lazy = Arc::new(LazyMlp {
        fc1: LazyLinear::new(64, &dev).unwrap(),
        fc2: LazyLinear::new(16, &dev).unwrap(),
    });
    let lazy_outputs = Arc::new(std::sync::Mutex::new(Vec::new()));

    let barrier = Arc::new(Barrier::new(4 * THREADS_PER_MODE));
    let mut handles = Vec::new();
    for mode in 0..4 {
        for _ in 0..THREADS_PER_MODE {
            let (model, x, hooks, other, lazy, lazy_outputs, barrier) = (
                model.clone(),
                x.clone(),
                hooks.clone(),
                other.clone(),
                lazy.clone(),
                lazy_outputs.clone(),
                barrier.clone(),
            );
            let (plain, hooked, substituted) = (plain.clone(), hooked.clone(), substituted.clone());
            handles.push(std::thread::spawn(move || -> (usize, usize) {
                barrier.wait();
                let start = Instant::now();
                let mut n = 0;
                while start.elapsed() < RUN_FOR {
                    match mode {
                        0 => assert_eq!(values(&model.call(&x).unwrap()), plain),
                        1 => {
                            let y = hooks.run(&*model, |m| m.call(&x)).unwrap();
                            assert_eq!(values(&y), hooked);
                        }
                        2 => {
                            let y = model.functional_call(&other, &x).unwrap();
                            assert_eq!(values(&y), substituted);
                        }
                        _ => {
                            let y = values(&lazy.call(&x).unwrap());
                            if n == 0 {
                                lazy_outputs.lock().unwrap().push(y);
                            }
                        }
                    }
                    n += 1;
                }
                (mode, n)
            }));
        }
    }
    let mut calls = [0; 4];
    for h in handles {
        let (mode, n) = h.join().expect("a calling thread panicked");
        calls[mode] += n;
    }
    assert_eq!(fired.load(Ordering::Relaxed), calls[1]);
    // The lazy model was built once: every thread's first output is the built model's.
    let built = values(&lazy.call(&x).unwrap());
    let firsts = lazy_outputs.lock().unwrap();
    assert_eq!(firsts.len(), THREADS_PER_MODE);
    assert!(firsts.iter().all(|y| *y == built));
    // And the model itself never changed.
    assert_eq!(values(&model.call(&x).unwrap()), plain);
    calls
}
