//! The recurrent-state convention (RETURNN's `Module.default_initial_state`): a module with
//! recurrent state takes its state as an argument and returns the new one, so composite models
//! thread state through their parts uniformly and run over a whole sequence or one step at a time.

use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::TensorTree;

/// A module with recurrent state: [`initial_state`](Self::initial_state) makes the state for a
/// batch, [`step`](Self::step) consumes one time step's input and a state and returns the
/// output and the next state, and [`scan`](Self::scan) does the same over a whole sequence.
///
/// The state is a plain value — a tensor, a tuple, a [`TensorStruct`](crate::TensorStruct) —
/// with the same structure going in and coming out, so a model made of recurrent parts has as
/// its state the tuple (or struct) of its parts' states and threads each part's state through
/// that part. Nothing is hidden in the module: the same model can serve many streams at once,
/// each with its own state.
///
/// Implemented by [`Lstm`](crate::Lstm) and [`Gru`](crate::Gru) (state tensors
/// `[num_layers, batch, hidden]`, like their `h_n`/`c_n`) and by [`LstmCell`](crate::LstmCell)
/// and [`GruCell`](crate::GruCell) (state tensors `[batch, hidden]`). An LSTM's state is
/// `(h, c)`, a GRU's `h`.
///
/// A composite of two recurrent parts (its `scan` comes for free):
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{GruCell, LstmCell};
/// use module_runtime::Recurrent;
///
/// #[derive(Module)]
/// struct TwoLayer {
///     lower: LstmCell,
///     upper: GruCell,
/// }
///
/// /// The composite's state is its parts' states, side by side.
/// #[derive(TensorStruct, Clone)]
/// struct TwoLayerState {
///     lower: (Tensor, Tensor),
///     upper: Tensor,
/// }
///
/// impl Recurrent for TwoLayer {
///     type State = TwoLayerState;
///
///     fn initial_state(&self, batch: usize) -> Result<TwoLayerState> {
///         Ok(TwoLayerState {
///             lower: self.lower.initial_state(batch)?,
///             upper: self.upper.initial_state(batch)?,
///         })
///     }
///
///     fn step(&self, x: &Tensor, state: TwoLayerState) -> Result<(Tensor, TwoLayerState)> {
///         let (h, lower) = self.lower.step(x, state.lower)?;
///         let (y, upper) = self.upper.step(&h, state.upper)?;
///         Ok((y, TwoLayerState { lower, upper }))
///     }
/// }
///
/// let dev = Device::Cpu;
/// let model = TwoLayer { lower: LstmCell::new(3, 8, &dev)?, upper: GruCell::new(8, 5, &dev)? };
/// let xs = Tensor::randn(0f32, 1., (2, 7, 3), &dev)?; // [batch, time, feature]
///
/// // The whole sequence at once…
/// let (ys, last) = model.scan(&xs, model.initial_state(2)?)?;
/// assert_eq!(ys.dims(), [2, 7, 5]);
///
/// // …or one step at a time, with the state explicit: the same outputs and final state.
/// let mut state = model.initial_state(2)?;
/// for t in 0..7 {
///     let (y, next) = model.step(&xs.narrow(1, t, 1)?.squeeze(1)?, state)?;
///     let diff = (y - ys.narrow(1, t, 1)?.squeeze(1)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
///     assert!(diff < 1e-6);
///     state = next;
/// }
/// let diff = (state.upper - &last.upper)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff < 1e-6);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// A tuple works as well as a struct: `type State = ((Tensor, Tensor), Tensor);`.
pub trait Recurrent {
    /// The recurrent state: a tree of tensors ([`TensorTree`]: a tensor, a tuple, a
    /// [`TensorStruct`](crate::TensorStruct), …) whose structure [`step`](Self::step) keeps.
    type State: TensorTree + Clone;

    /// The state before the first step for `batch` independent sequences (zeros for the runtime's
    /// layers), on the module's device and in its dtype: RETURNN's `default_initial_state`.
    fn initial_state(&self, batch: usize) -> Result<Self::State>;

    /// One time step: the input for this step (`[batch, …]`, no time axis) and the state give the
    /// step's output and the next state.
    fn step(&self, input: &Tensor, state: Self::State) -> Result<(Tensor, Self::State)>;

    /// A whole sequence `[batch, time, …]` (time is axis 1, whatever a layer's `batch_first`
    /// says about its own `forward`) from `state`: the outputs stacked on axis 1,
    /// `[batch, time, …]`, and the final state.
    ///
    /// The default runs [`step`](Self::step) over the time axis; layers override it with a faster
    /// loop computing the same values.
    fn scan(&self, inputs: &Tensor, state: Self::State) -> Result<(Tensor, Self::State)> {
        let time = time_steps(inputs)?;
        let mut state = state;
        let mut outputs = Vec::with_capacity(time);
        for t in 0..time {
            let (y, next) = self.step(&inputs.narrow(1, t, 1)?.squeeze(1)?, state)?;
            outputs.push(y);
            state = next;
        }
        Ok((Tensor::stack(&outputs, 1)?, state))
    }
}

/// The length of the time axis (axis 1) of a `[batch, time, …]` sequence; at least one step.
fn time_steps(inputs: &Tensor) -> Result<usize> {
    match inputs.dims() {
        [_, t, ..] if *t > 0 => Ok(*t),
        _ => Err(Error::InputShape {
            layer: "Recurrent::scan",
            expected: "[batch, time >= 1, …]".to_owned(),
            got: inputs.shape().clone(),
        }),
    }
}

/// A shared (`Arc`) or boxed module steps like the module inside.
macro_rules! recurrent_through {
    ($($pointer:ident)::+) => {
        impl<M: Recurrent + ?Sized> Recurrent for $($pointer)::+<M> {
            type State = M::State;

            fn initial_state(&self, batch: usize) -> Result<Self::State> {
                (**self).initial_state(batch)
            }

            fn step(&self, input: &Tensor, state: Self::State) -> Result<(Tensor, Self::State)> {
                (**self).step(input, state)
            }

            fn scan(&self, inputs: &Tensor, state: Self::State) -> Result<(Tensor, Self::State)> {
                (**self).scan(inputs, state)
            }
        }
    };
}

recurrent_through!(std::sync::Arc);
recurrent_through!(Box);
