//! Unit tests of the KV block index.

use super::*;

fn h(v: u64) -> BlockHash {
    BlockHash::from_u64(v)
}

fn wide(v: u8) -> BlockHash {
    BlockHash::from_canonical([v; 32])
}

fn stored(hashes: &[BlockHash], parent: Option<BlockHash>, tokens: Vec<u32>) -> KvEvent {
    stored_in(hashes, parent, tokens, 4, Medium::Gpu, None)
}

fn stored_in(
    hashes: &[BlockHash],
    parent: Option<BlockHash>,
    tokens: Vec<u32>,
    block_size: u32,
    medium: Medium,
    lora_name: Option<&str>,
) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: tokens,
        block_size,
        lora_id: None,
        medium,
        lora_name: lora_name.map(str::to_owned),
        group_idx: None,
    }
}

fn removed(hashes: &[BlockHash], medium: Medium) -> KvEvent {
    KvEvent::BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium,
        group_idx: None,
    }
}

fn apply(cache: &mut EndpointCache, events: &[KvEvent]) -> ApplyStats {
    let mut stats = ApplyStats::default();
    for e in events {
        cache.apply(e, &mut stats);
    }
    stats
}

fn toks(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

/// Keys of consecutive 4-token blocks of `tokens`, from `parent`.
fn chain(parent: u64, tokens: &[u32]) -> Vec<u64> {
    let mut out = Vec::new();
    let mut p = parent;
    for span in tokens.chunks_exact(4) {
        p = block_key(p, span);
        out.push(p);
    }
    out
}

#[test]
fn block_key_is_seeded_xxh3_of_le_tokens() {
    for n in [0usize, 1, 16, 64, 65, 100, 300] {
        let tokens: Vec<u32> = (0..n as u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(
            block_key(42, &tokens),
            xxh3_64_with_seed(&bytes, 42),
            "{n} tokens"
        );
    }
    assert_ne!(block_key(1, &[5]), block_key(2, &[5]));
}

#[test]
fn roots_differ_per_adapter() {
    let roots = [
        root_key(None),
        root_key(Some("")),
        root_key(Some("a")),
        root_key(Some("b")),
        event_root(None, Some(1)),
        event_root(None, Some(2)),
    ];
    for (i, a) in roots.iter().enumerate() {
        for b in &roots[i + 1..] {
            assert_ne!(a, b);
        }
    }
    assert_eq!(event_root(Some("a"), Some(9)), root_key(Some("a")));
    assert_eq!(event_root(None, None), root_key(None));
}

#[test]
fn chains_continue_from_parents_across_events() {
    let mut cache = EndpointCache::new();
    let t = toks(0..16);
    let keys = chain(root_key(None), &t);
    let stats = apply(
        &mut cache,
        &[
            stored(&[h(1), h(2)], None, t[..8].to_vec()),
            stored(&[h(3)], Some(h(2)), t[8..12].to_vec()),
            stored(&[h(4)], Some(h(3)), t[12..].to_vec()),
        ],
    );
    assert_eq!(stats.stored, 4);
    assert_eq!(stats.store_events, 3);
    assert_eq!(stats.events(), 3);
    assert_eq!(stats.orphan_blocks + stats.malformed + stats.hash_keyed, 0);
    for (i, key) in keys.iter().enumerate() {
        assert_eq!(cache.key_of(&h(i as u64 + 1)), Some(*key));
        assert!(cache.contains_key(*key, Tier::Gpu));
        assert!(!cache.contains_key(*key, Tier::Cpu));
    }
    assert_eq!(cache.blocks(Tier::Gpu), 4);
    let mut held: Vec<u64> = cache
        .engine_hashes(Tier::Gpu)
        .filter_map(|h| h.as_u64())
        .collect();
    held.sort_unstable();
    assert_eq!(held, vec![1, 2, 3, 4]);
}

#[test]
fn equal_content_gets_equal_keys_on_two_servers() {
    let t = toks(100..112);
    let (mut a, mut b) = (EndpointCache::new(), EndpointCache::new());
    let _ = apply(&mut a, &[stored(&[h(1), h(2), h(3)], None, t.clone())]);
    let _ = apply(
        &mut b,
        &[
            stored(&[wide(9)], None, t[..4].to_vec()),
            stored(&[h(u64::MAX), h(77)], Some(wide(9)), t[4..].to_vec()),
        ],
    );
    for (x, y) in [(h(1), wide(9)), (h(2), h(u64::MAX)), (h(3), h(77))] {
        assert!(a.key_of(&x).is_some());
        assert_eq!(a.key_of(&x), b.key_of(&y));
    }
    // A LoRA adapter's blocks with the same tokens key differently.
    let mut c = EndpointCache::new();
    let _ = apply(
        &mut c,
        &[stored_in(
            &[h(1)],
            None,
            t[..4].to_vec(),
            4,
            Medium::Gpu,
            Some("ad"),
        )],
    );
    assert_ne!(c.key_of(&h(1)), a.key_of(&h(1)));
    assert_eq!(
        c.key_of(&h(1)),
        Some(block_key(root_key(Some("ad")), &t[..4]))
    );
}

#[test]
fn tiers_are_counted_separately() {
    let mut cache = EndpointCache::new();
    let t = toks(0..8);
    let keys = chain(root_key(None), &t);
    // GPU with tokens, then CPU the way vLLM's offloading connector says it: no tokens.
    let stats = apply(
        &mut cache,
        &[
            stored(&[h(1), h(2)], None, t.clone()),
            stored_in(&[h(1), h(2)], None, vec![], 0, Medium::Cpu, None),
        ],
    );
    assert_eq!((stats.malformed, stats.hash_keyed), (0, 0));
    assert_eq!(cache.blocks(Tier::Gpu), 2);
    assert_eq!(cache.blocks(Tier::Cpu), 2);
    assert_eq!(cache.key_of(&h(2)), Some(keys[1]));
    assert!(cache.contains_key(keys[1], Tier::Cpu));
    // GPU eviction keeps the CPU copy and its key.
    let stats = apply(&mut cache, &[removed(&[h(2)], Medium::Gpu)]);
    assert_eq!(stats.removed, 1);
    assert!(!cache.contains_engine_hash(&h(2), Tier::Gpu));
    assert!(cache.contains_engine_hash(&h(2), Tier::Cpu));
    assert!(!cache.contains_key(keys[1], Tier::Gpu));
    assert!(cache.contains_key(keys[1], Tier::Cpu));
    assert_eq!(cache.key_of(&h(2)), Some(keys[1]));
    // Gone from every tier: no key any more.
    let _ = apply(&mut cache, &[removed(&[h(2)], Medium::Cpu)]);
    assert_eq!(cache.key_of(&h(2)), None);
    assert!(!cache.contains_key(keys[1], Tier::Cpu));
    assert_eq!((cache.blocks(Tier::Gpu), cache.blocks(Tier::Cpu)), (1, 1));
    assert_eq!(cache.keys(Tier::Gpu).collect::<Vec<_>>(), vec![keys[0]]);
}

#[test]
fn other_media_count_as_storage() {
    let mut cache = EndpointCache::new();
    let stats = apply(
        &mut cache,
        &[
            stored_in(
                &[h(5)],
                None,
                toks(0..4),
                4,
                Medium::Other("NVME".into()),
                None,
            ),
            stored_in(&[h(5)], None, toks(0..4), 4, Medium::Storage, None),
            removed(&[h(5)], Medium::Other("REMOTE".into())),
        ],
    );
    assert_eq!(stats.other_medium, 2);
    assert!(cache.contains_engine_hash(&h(5), Tier::Storage));
    let _ = apply(&mut cache, &[removed(&[h(5)], Medium::Storage)]);
    assert_eq!(cache.blocks(Tier::Storage), 0);
}

#[test]
fn residency_is_counted_per_tier() {
    let mut cache = EndpointCache::new();
    let twice = stored(&[h(1)], None, toks(0..4));
    let _ = apply(&mut cache, &[twice.clone(), twice]);
    assert_eq!(cache.blocks(Tier::Gpu), 1);
    let _ = apply(&mut cache, &[removed(&[h(1)], Medium::Gpu)]);
    assert!(cache.contains_engine_hash(&h(1), Tier::Gpu));
    let stats = apply(
        &mut cache,
        &[removed(&[h(1)], Medium::Gpu), removed(&[h(1)], Medium::Gpu)],
    );
    assert_eq!((stats.removed, stats.unknown_removals), (1, 1));
    assert_eq!(cache.blocks(Tier::Gpu), 0);
}

#[test]
fn unknown_removals_change_nothing() {
    let mut cache = EndpointCache::new();
    let _ = apply(&mut cache, &[stored(&[h(1)], None, toks(0..4))]);
    let stats = apply(
        &mut cache,
        &[
            removed(&[h(2), wide(3)], Medium::Gpu),
            removed(&[h(1)], Medium::Cpu),
        ],
    );
    assert_eq!(
        (stats.removed, stats.unknown_removals, stats.remove_events),
        (0, 3, 2)
    );
    assert_eq!(cache.blocks(Tier::Gpu), 1);
    assert!(cache.key_of(&h(1)).is_some());
}

#[test]
fn orphan_chains_use_a_stand_in_parent() {
    let mut cache = EndpointCache::new();
    let t = toks(0..8);
    let stats = apply(
        &mut cache,
        &[stored(&[h(11), h(12)], Some(h(10)), t.clone())],
    );
    assert_eq!(stats.orphan_blocks, 2);
    let keys = chain(hash_key(&h(10)), &t);
    assert_eq!(cache.key_of(&h(12)), Some(keys[1]));
    // The parent turning up later without tokens gets the stand-in key: consistent.
    let stats = apply(
        &mut cache,
        &[stored_in(&[h(10)], None, vec![], 0, Medium::Cpu, None)],
    );
    assert_eq!(stats.hash_keyed, 1);
    assert_eq!(cache.key_of(&h(10)), Some(hash_key(&h(10))));
    // An orphan chain through an already held block continues from its key, not an orphan.
    let stats = apply(
        &mut cache,
        &[stored(&[h(11), h(13)], Some(h(99)), toks(0..8))],
    );
    assert_eq!(stats.orphan_blocks, 0);
    assert_eq!(cache.key_of(&h(13)), Some(block_key(keys[0], &t[4..])));
}

#[test]
fn recently_removed_blocks_still_give_their_key() {
    let mut cache = EndpointCache::new().with_recent_removed(2);
    let t = toks(0..12);
    let keys = chain(root_key(None), &t);
    let _ = apply(&mut cache, &[stored(&[h(1), h(2)], None, t[..8].to_vec())]);
    let _ = apply(&mut cache, &[removed(&[h(2)], Medium::Gpu)]);
    assert_eq!(cache.key_of(&h(2)), None);
    // A sequence extending the evicted block's chain, and a late token-less offload store.
    let stats = apply(
        &mut cache,
        &[
            stored(&[h(3)], Some(h(2)), t[8..].to_vec()),
            stored_in(&[h(2)], None, vec![], 0, Medium::Cpu, None),
        ],
    );
    assert_eq!((stats.orphan_blocks, stats.hash_keyed), (0, 0));
    assert_eq!(cache.key_of(&h(3)), Some(keys[2]));
    assert_eq!(cache.key_of(&h(2)), Some(keys[1]));
    assert!(cache.contains_key(keys[1], Tier::Cpu));
    // Beyond the cap the oldest removed block is forgotten.
    let _ = apply(
        &mut cache,
        &[
            removed(&[h(1), h(3)], Medium::Gpu),
            removed(&[h(2)], Medium::Cpu),
        ],
    );
    let stats = apply(&mut cache, &[stored(&[h(4)], Some(h(1)), t[4..8].to_vec())]);
    assert_eq!(stats.orphan_blocks, 1);
    let stats = apply(&mut cache, &[stored(&[h(5)], Some(h(3)), t[4..8].to_vec())]);
    assert_eq!(stats.orphan_blocks, 0);
    assert_eq!((cache.resident(), cache.remembered()), (2, 2));
}

#[test]
fn clears_bump_the_generation() {
    let mut cache = EndpointCache::new();
    assert_eq!(cache.generation(), 0);
    let t = toks(0..4);
    let _ = apply(
        &mut cache,
        &[
            stored(&[h(1)], None, t.clone()),
            stored_in(&[h(1)], None, vec![], 0, Medium::Cpu, None),
        ],
    );
    let stats = apply(&mut cache, &[KvEvent::AllBlocksCleared]);
    assert_eq!((stats.cleared, stats.events()), (1, 1));
    assert_eq!(cache.generation(), 1);
    for tier in Tier::ALL {
        assert_eq!(cache.blocks(tier), 0);
        assert_eq!(cache.engine_hashes(tier).count(), 0);
        assert_eq!(cache.keys(tier).count(), 0);
    }
    assert_eq!(cache.key_of(&h(1)), None);
    // Stored again after the reset: same key (remembered), removable again.
    let _ = apply(
        &mut cache,
        &[stored_in(&[h(1)], None, vec![], 0, Medium::Cpu, None)],
    );
    assert_eq!(cache.key_of(&h(1)), Some(block_key(root_key(None), &t)));
    // A publisher restart forgets removed blocks too.
    let _ = apply(&mut cache, &[removed(&[h(1)], Medium::Cpu)]);
    cache.clear();
    assert_eq!(cache.generation(), 2);
    let stats = apply(
        &mut cache,
        &[stored_in(&[h(1)], None, vec![], 0, Medium::Cpu, None)],
    );
    assert_eq!(stats.hash_keyed, 1);
    assert_eq!(cache.key_of(&h(1)), Some(hash_key(&h(1))));
}

#[test]
fn inconsistent_token_counts_are_malformed_but_recorded() {
    let mut cache = EndpointCache::new();
    let stats = apply(
        &mut cache,
        &[
            stored(&[h(1), h(2)], None, toks(0..7)),
            stored(&[h(3)], None, toks(0..9)),
            stored_in(&[h(4)], None, toks(0..4), 0, Medium::Gpu, None),
            stored(&[], None, toks(0..4)),
            stored(&[], None, vec![]),
        ],
    );
    assert_eq!(stats.malformed, 4);
    assert_eq!(stats.hash_keyed, 4);
    assert_eq!(cache.blocks(Tier::Gpu), 4);
    assert_eq!(cache.key_of(&h(2)), Some(hash_key(&h(2))));
    let stats = apply(
        &mut cache,
        &[removed(&[h(1), h(2), h(3), h(4)], Medium::Gpu)],
    );
    assert_eq!(stats.removed, 4);
    assert_eq!(cache.blocks(Tier::Gpu), 0);
}

#[test]
fn odd_inputs_never_panic() {
    let mut cache = EndpointCache::new().with_recent_removed(0);
    let huge = KvEvent::BlockStored {
        block_hashes: vec![h(1); 3],
        parent_block_hash: Some(h(1)),
        token_ids: vec![u32::MAX; 5],
        block_size: u32::MAX,
        lora_id: Some(i64::MIN),
        medium: Medium::Other(String::new()),
        lora_name: Some(String::new()),
        group_idx: Some(-1),
    };
    let unknown = KvEvent::Unknown {
        type_name: "Foo".into(),
    };
    let stats = apply(
        &mut cache,
        &[
            huge.clone(),
            unknown,
            huge,
            removed(&[], Medium::Gpu),
            KvEvent::AllBlocksCleared,
        ],
    );
    assert_eq!(stats.unknown_events, 1);
    assert_eq!(stats.events(), 5);
    assert_eq!(cache.blocks(Tier::Storage), 0);
    assert_eq!(cache.resident() + cache.remembered(), 0);
    // A parent that is the block itself, with long blocks (streamed hashing).
    let _ = apply(
        &mut cache,
        &[stored_in(
            &[h(1), h(1)],
            Some(h(1)),
            toks(0..200),
            100,
            Medium::Gpu,
            None,
        )],
    );
    assert_eq!(cache.blocks(Tier::Gpu), 1);
}

#[test]
fn stats_add_up() {
    let mut a = ApplyStats {
        stored: 1,
        store_events: 1,
        ..ApplyStats::default()
    };
    let b = ApplyStats {
        removed: 2,
        remove_events: 2,
        unknown_events: 1,
        malformed: 3,
        ..ApplyStats::default()
    };
    a.add(&b);
    assert_eq!((a.stored, a.removed, a.malformed, a.events()), (1, 2, 3, 4));
}

#[test]
fn the_block_cap_bounds_resident_blocks_and_keeps_chains_keyed() {
    let mut cache = EndpointCache::new();
    cache.set_block_cap(3);
    let hashes: Vec<BlockHash> = (1..=5).map(h).collect();
    let s = apply(&mut cache, &[stored(&hashes, None, toks(0..20))]);
    assert_eq!((s.stored, s.over_cap), (3, 2));
    assert_eq!(cache.blocks(Tier::Gpu), 3);
    assert_eq!(cache.key_of(&h(4)), None, "over the cap: not stored");
    // A block already held is still counted in another tier, and a removal makes room.
    let s = apply(
        &mut cache,
        &[stored_in(&[h(1)], None, vec![], 4, Medium::Cpu, None)],
    );
    assert_eq!((s.stored, s.over_cap), (1, 0));
    let s = apply(
        &mut cache,
        &[
            removed(&[h(3)], Medium::Gpu),
            stored(&[h(4)], Some(h(3)), toks(12..16)),
        ],
    );
    assert_eq!((s.stored, s.over_cap), (1, 0));
    let keys = chain(root_key(None), &toks(0..20));
    assert_eq!(
        cache.key_of(&h(4)),
        Some(keys[3]),
        "keyed under its removed parent"
    );
}

#[test]
fn malformed_and_unknown_events_say_what_was_wrong() {
    let mut cache = EndpointCache::new();
    let s = apply(
        &mut cache,
        &[
            stored(&[h(1), h(2)], None, toks(0..7)),
            KvEvent::Unknown {
                type_name: "BlockMoved".into(),
            },
        ],
    );
    let m = s.first_malformed.unwrap();
    assert_eq!((m.block_hashes, m.block_size, m.token_ids), (2, 4, 7));
    assert!(m.to_string().contains("7 token ids"), "{m}");
    assert_eq!(s.first_unknown.unwrap().as_str(), "BlockMoved");
    assert_eq!(UnknownType::new(&"é".repeat(40)).as_str().len(), 64);
}
