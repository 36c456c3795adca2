//! Row lookups in a sharded table (an embedding's): the rows are read from the gathered table in
//! the forward, and their gradient goes straight to the rank's shard in the backward, so the
//! table is never gathered again for it.
//!
//! An embedding's backward needs only the ids and the table's shape. Read through the gathered
//! table as any other weight, it would be gathered again before the backward and, in candle's
//! backward, summed into a zero-filled table-sized gradient next to the table: three full
//! copies at once. Here the op's argument is the shard: its backward adds the rows' gradient into
//! one table-sized buffer, reduce-scatters (averages) it into the shard's gradient, and drops it.

use std::rc::Rc;
use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use module_core::scope::RowLookup;
use module_distributed::ReduceOp;

use super::gather::{runtime, take_once, take_storage};

/// The lookup [`Param::scoped_rows`](module_core::Param::scoped_rows) calls for a `[rows, dim]`
/// parameter whose gathered values are `table` and whose shard is `shard` (tracked when the
/// parameter is trained).
pub(super) fn lookup(id: u64, table: &Tensor, shard: &Tensor) -> RowLookup {
    let (table, shard) = (table.detach(), shard.clone());
    Rc::new(move |ids: &Tensor| {
        let values = read_rows(&table, ids)?;
        let op = LookupRows {
            id,
            ids: ids.clone(),
            table: table.shape().clone(),
            values: Mutex::new(Some(values)),
        };
        let op: Arc<Box<dyn CustomOp1 + Send + Sync>> = Arc::new(Box::new(op));
        Ok(shard.apply_op1_arc(op)?)
    })
}

/// Rows `ids` of `table`, as a storage of their own (the selection's, taken out of it).
fn read_rows(table: &Tensor, ids: &Tensor) -> candle_core::Result<CpuStorage> {
    take_storage(&table.index_select(ids, 0)?)
}

/// Rows of a sharded table: forward hands out the rows read beforehand; backward adds their
/// gradient into a table-sized buffer and reduce-scatters it into the shard's gradient.
struct LookupRows {
    id: u64,
    /// The flat ids (`[n]`).
    ids: Tensor,
    /// The table's shape, `[rows, dim]`.
    table: Shape,
    values: Mutex<Option<CpuStorage>>,
}

impl CustomOp1 for LookupRows {
    fn name(&self) -> &'static str {
        "fsdp-lookup-rows"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (_, dim) = self.table.dims2()?;
        let values = take_once(&self.values, "row lookup")?;
        Ok((values, Shape::from((self.ids.elem_count(), dim))))
    }

    fn bwd(
        &self,
        shard: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let rt = runtime(self.id).map_err(module_core::error::carry)?;
        let world = rt.comm.world_size();
        let chunk = shard.elem_count();
        let (rows, dim) = self.table.dims2()?;
        // One buffer of the padded flat size; the table is its first `rows * dim` values.
        let dense = Tensor::zeros(world * chunk, shard.dtype(), shard.device())?;
        let table = dense.narrow(0, 0, rows * dim)?.reshape((rows, dim))?;
        let n = self.ids.elem_count();
        let index = match self.ids.dtype() {
            DType::U8 => self.ids.to_dtype(DType::U32)?,
            _ => self.ids.clone(),
        };
        let index = index
            .reshape((n, 1))?
            .broadcast_as((n, dim))?
            .contiguous()?;
        let grad = grad.to_dtype(shard.dtype())?.contiguous()?;
        // In id order, as candle's `index_add` (the unsharded embedding's backward) adds them.
        table.scatter_add_set(&index, &grad, 0)?;
        drop((table, grad, index));
        let out = Tensor::zeros(chunk, shard.dtype(), shard.device())?;
        rt.comm
            .reduce_scatter(&dense, &out, ReduceOp::Avg)
            .map_err(module_core::error::carry)?;
        Ok(Some(out))
    }
}
