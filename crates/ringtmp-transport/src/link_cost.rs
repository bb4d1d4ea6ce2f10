//! What a link costs the CPU of the node at either end, per byte: framing, and on a
//! private link sealing and opening its records. On a strong machine this is a few percent of a
//! stage's work; on a weak board (or an emulated one) it is of the order of the stage's compute,
//! and a planner that prices only the layers overloads the board. Measured by sending tensor
//! frames through a real link's writer and reader over an in-memory pipe on one thread, so both
//! halves (the sender's and the receiver's) are timed on this CPU.

use std::time::{Duration, Instant};

use ringtmp_wire::{Dtype, Limits, Message, TensorHeader, TensorTag};
use tokio::io::AsyncWriteExt;

use crate::framed::{read_frame, write_frame};
use crate::secure::{Cipher, SecureReader, SecureWriter, establish, psk};

/// Seconds of CPU per byte for sending a frame on one node and receiving it on another, both
/// counted (a node sends and receives as many bytes as each other per micro-batch), measured
/// with frames of `frame_bytes` for about `budget` (at least one frame). `encrypt`: a private
/// link (the default; sealed with the cipher of a link between two nodes like this one,
/// [`Cipher::between_two_like_this`]) or plain frames (`--insecure-plaintext`).
pub fn seconds_per_byte(
    encrypt: bool,
    frame_bytes: usize,
    budget: Duration,
) -> Result<f64, String> {
    // On a thread of its own: a caller inside a runtime (a node answering at rendezvous) cannot
    // start another on its own thread.
    std::thread::scope(|scope| {
        scope
            .spawn(|| probe(encrypt, frame_bytes, budget))
            .join()
            .unwrap_or_else(|_| Err("the probe panicked".into()))
    })
}

fn probe(encrypt: bool, frame_bytes: usize, budget: Duration) -> Result<f64, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| format!("starting a runtime: {e}"))?;
    runtime.block_on(async move {
        let (mut a, mut b) = tokio::io::duplex(1 << 20);
        let sessions = if encrypt {
            let key = psk(b"link cost probe");
            let cipher = Cipher::between_two_like_this();
            let (sa, sb) = tokio::join!(
                establish(&mut a, true, &key, b"probe", cipher),
                establish(&mut b, false, &key, b"probe", cipher)
            );
            Some((sa?, sb?))
        } else {
            None
        };
        let values = frame_bytes.div_ceil(4).max(1);
        let header = TensorHeader {
            run_id: 0,
            step: 0,
            micro_batch: 0,
            tag: TensorTag::Probe,
            dtype: Dtype::F32,
            shape: vec![values as u32],
        };
        let message = Message::Tensor(header, vec![7u8; values * 4]);
        let limits = Limits::default();
        let (mut writer, mut reader): (
            Box<dyn tokio::io::AsyncWrite + Unpin>,
            Box<dyn tokio::io::AsyncRead + Unpin>,
        ) = match sessions {
            Some((sa, sb)) => (
                Box::new(SecureWriter::new(a, sa)),
                Box::new(SecureReader::new(b, sb)),
            ),
            None => (Box::new(a), Box::new(b)),
        };
        let (mut scratch, mut buf) = (Vec::new(), Vec::new());
        let (mut frames, mut bytes) = (0u64, 0u64);
        let started = Instant::now();
        while frames == 0 || started.elapsed() < budget {
            let send = async {
                let n = write_frame(&mut writer, &message, &mut scratch).await?;
                writer.flush().await?;
                Ok::<usize, std::io::Error>(n)
            };
            let (sent, received) = tokio::join!(send, read_frame(&mut reader, &mut buf, &limits));
            let n = sent.map_err(|e| format!("sending the probe: {e}"))?;
            received.map_err(|e| format!("receiving the probe: {e:?}"))?;
            frames += 1;
            bytes += n as u64;
        }
        Ok(started.elapsed().as_secs_f64() / bytes.max(1) as f64)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    // Also from inside a runtime, as a node answering at rendezvous calls it.
    #[test]
    fn it_runs_inside_a_runtime_too() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let cost = rt.block_on(async { seconds_per_byte(true, 1 << 10, Duration::from_millis(5)) });
        assert!(cost.unwrap() > 0.0);
    }

    #[test]
    fn a_private_link_costs_more_per_byte_than_a_plain_one_and_both_are_positive() {
        let budget = Duration::from_millis(100);
        let private = seconds_per_byte(true, 256 << 10, budget).unwrap();
        let plain = seconds_per_byte(false, 256 << 10, budget).unwrap();
        assert!(plain > 0.0 && private > 0.0, "{plain} {private}");
        // Sealing and opening every record is not free; a wide margin keeps this robust.
        assert!(private > plain, "private {private} s/B, plain {plain} s/B");
        println!(
            "per MB: private {:.2} ms, plain {:.2} ms",
            private * 1e9,
            plain * 1e9
        );
    }
}
