//! A whole model on the wire: the one `Params` tensor that the elastic ring sends a member it
//! re-admits, that gossip's peers exchange and that workers send rank 0 at the end. Its header's
//! `step` and `micro_batch` say what it is for; its count is checked on receipt with [`holds`].

/// A whole model as a `Params` tensor of `dtype` on the wire; `step` and `kind` (its
/// `micro_batch`) say what it is for.
pub fn model_message(
    net: &dyn ringtmp_transport::Transport,
    model: &[f32],
    step: u64,
    kind: u64,
    dtype: ringtmp_wire::Dtype,
) -> ringtmp_wire::Message {
    use ringtmp_wire::{TensorHeader, TensorTag};
    let header = TensorHeader {
        run_id: 0,
        step,
        micro_batch: kind,
        tag: TensorTag::Params,
        dtype,
        shape: vec![model.len() as u32],
    };
    let mut payload = net.buffers().take(model.len() * dtype.size() as usize);
    ringtmp_wire::message::tensor_bytes_into(model, dtype, &mut payload);
    ringtmp_wire::Message::Tensor(header, payload)
}

/// Whether a tensor is a model of `len` values: its header's count (checked against the payload
/// when the frame was decoded; a phantom run's payload carries no values).
pub fn holds(header: &ringtmp_wire::TensorHeader, len: usize) -> bool {
    header.elements() == Some(len as u64)
}
