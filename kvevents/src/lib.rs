//! KV-cache events as vLLM and SGLang publish them: typed values, the msgpack wire forms, and
//! the ZMQ transport.
//!
//! It depends on no other kvoy crate, and only its transport on ZMQ: the decoders are plain
//! functions over bytes.
//!
//! The aggregator decodes every payload at its edge with [`decode_batch`] (total: any bytes
//! give a batch or a [`DecodeError`], never a panic) and subscribes with [`Subscriber`] /
//! [`ReplayClient`], following sequence numbers with [`SeqTracker`]. The simulator encodes with
//! [`encode_batch`] in vLLM's current map form or its older array form and publishes through
//! [`Publisher`]. Block hashes of every width become one canonical [`BlockHash`].
//!
//! ```
//! use kvoy_kvevents::{decode_batch, encode_batch, BlockHash, EventBatch, KvEvent, Medium, WireForm};
//!
//! let batch = EventBatch {
//!     ts: 1_700_000_000.25,
//!     events: vec![
//!         KvEvent::BlockStored {
//!             block_hashes: vec![BlockHash::from_u64(u64::MAX), BlockHash::from_i64(-7)],
//!             parent_block_hash: None,
//!             token_ids: (0..32).collect(),
//!             block_size: 16,
//!             lora_id: None,
//!             medium: Medium::Gpu,
//!             lora_name: None,
//!             group_idx: None,
//!         },
//!         KvEvent::AllBlocksCleared,
//!     ],
//!     data_parallel_rank: Some(0),
//! };
//! for form in [WireForm::Map, WireForm::Array] {
//!     let payload = encode_batch(&batch, form);
//!     assert_eq!(decode_batch(&payload), Ok(batch.clone()));
//! }
//! // Unknown event types are kept as `Unknown`, for the caller to count and skip.
//! let odd = decode_batch(&[0x92, 0x00, 0x91, 0x91, 0xa3, b'F', b'o', b'o']).unwrap();
//! assert_eq!(odd.events, vec![KvEvent::Unknown { type_name: "Foo".into() }]);
//! ```
//!
//! The ZMQ half (feature `zmq`, on by default) links libzmq built from vendored sources.

mod decode;
mod encode;
mod error;
mod event;
mod hash;
mod msgpack;
mod seq;
#[cfg(feature = "zmq")]
mod transport;

pub use decode::decode_batch;
pub use encode::{encode_batch, encode_batch_into, WireForm};
pub use error::DecodeError;
pub use event::{EventBatch, KvEvent, Medium};
pub use hash::BlockHash;
pub use seq::{SeqStatus, SeqTracker};
#[cfg(feature = "zmq")]
pub use transport::{
    Message, Publisher, PublisherConfig, ReplayClient, ReplayLimits, ReplayOutcome, Subscriber,
    TransportError, ZmqContext, END_SEQ,
};
