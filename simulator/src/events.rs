//! Where a simulator's KV events go: nowhere, or a ZMQ publisher in vLLM's wire format
//! (`[topic, seq, msgpack batch]`, map events by default, the older array form by flag).

use std::net::SocketAddr;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};

use kvoy_kvevents::{
    BlockHash, EventBatch, KvEvent as WireEvent, Medium, Publisher, PublisherConfig, WireForm,
};

use crate::cli::Options;
use crate::engine::KvEvent;
use crate::server::runtime::EventSink;

/// `tcp://host:port` with the port moved up by `offset` (for `--count`); other endpoints as given.
fn offset_endpoint(endpoint: &str, offset: u16) -> Result<String> {
    if offset == 0 {
        return Ok(endpoint.to_owned());
    }
    let (head, port) = endpoint
        .rsplit_once(':')
        .with_context(|| format!("{endpoint:?} has no port to count up from"))?;
    let port: u16 = port
        .parse()
        .with_context(|| format!("{endpoint:?}: with --count, give a numeric port"))?;
    let port = port
        .checked_add(offset)
        .with_context(|| format!("{endpoint:?}: port overflows"))?;
    Ok(format!("{head}:{port}"))
}

fn medium(m: &str) -> Medium {
    Medium::from_wire(m)
}

/// The engine's events in the wire crate's types.
pub fn to_wire(events: Vec<KvEvent>) -> Vec<WireEvent> {
    events
        .into_iter()
        .map(|e| match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium: m,
            } => WireEvent::BlockStored {
                block_hashes: block_hashes.into_iter().map(BlockHash::from_u64).collect(),
                parent_block_hash: parent_block_hash.map(BlockHash::from_u64),
                token_ids,
                block_size,
                lora_id: None,
                medium: medium(m),
                lora_name: None,
                group_idx: None,
            },
            KvEvent::BlockRemoved {
                block_hashes,
                medium: m,
            } => WireEvent::BlockRemoved {
                block_hashes: block_hashes.into_iter().map(BlockHash::from_u64).collect(),
                medium: medium(m),
                group_idx: None,
            },
            KvEvent::AllBlocksCleared => WireEvent::AllBlocksCleared,
        })
        .collect()
}

/// The event sink of simulator number `index` (of `--count`), serving on `addr`.
pub fn sink(options: &Options, index: u16, addr: SocketAddr) -> Result<EventSink> {
    let kv = &options.kv_events;
    let Some(endpoint) = &kv.endpoint else {
        return Ok(Box::new(|_events| {}));
    };
    let config = PublisherConfig {
        endpoint: offset_endpoint(endpoint, index)?,
        replay_endpoint: kv
            .replay_endpoint
            .as_deref()
            .map(|e| offset_endpoint(e, index))
            .transpose()?,
        // vLLM's default (`KVEventsConfig.topic = ""`): an empty topic frame. Consumers that
        // match the topic exactly (vLLM's router's static `--kv-event-source`) need it;
        // llm-d's `kv@<pod>@<model>` convention is a topic the operator sets.
        topic: kv.topic.clone().unwrap_or_default(),
        // The simulator is the server: it binds whatever address it is given.
        always_bind: true,
        ..PublisherConfig::default()
    };
    let publisher = Publisher::start(config).context("cannot start the KV-event publisher")?;
    log::info!("KV events for {addr} on {}", publisher.endpoint());
    let form = if kv.array_form {
        WireForm::Array
    } else {
        WireForm::Map
    };
    Ok(Box::new(move |events| {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let batch = EventBatch {
            ts,
            events: to_wire(events),
            data_parallel_rank: None,
        };
        if let Err(e) = publisher.publish_batch(&batch, form) {
            log::warn!("KV events not published: {e}");
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_count_up() {
        assert_eq!(
            offset_endpoint("tcp://127.0.0.1:5557", 0).unwrap(),
            "tcp://127.0.0.1:5557"
        );
        assert_eq!(
            offset_endpoint("tcp://127.0.0.1:5557", 2).unwrap(),
            "tcp://127.0.0.1:5559"
        );
        assert!(offset_endpoint("tcp://127.0.0.1:*", 1).is_err());
    }
}
