use super::*;

const BS: u32 = 16;

fn ep(port: u16) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, 1], port))
}

fn h(n: u64) -> BlockHash {
    BlockHash::from_u64(n)
}

/// `n` keys numbered from `first` (keys chain: a prompt's first `n` keys).
fn keys(first: u64, n: u64) -> Vec<BlockKey> {
    (first..first + n).map(BlockKey).collect()
}

fn decision(port: u16, keys: Vec<BlockKey>) -> RelayedDecision {
    RelayedDecision {
        endpoint: ep(port),
        keys,
        routed_at_ms: None,
    }
}

fn stored(blocks: std::ops::Range<u64>, parent: Option<u64>) -> KvEvent {
    let n = blocks.end - blocks.start;
    KvEvent::BlockStored {
        block_hashes: blocks.map(h).collect(),
        parent_block_hash: parent.map(h),
        token_ids: vec![1; (n * u64::from(BS)) as usize],
        block_size: BS,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: None,
        group_idx: None,
    }
}

fn removed(blocks: &[u64]) -> KvEvent {
    KvEvent::BlockRemoved {
        block_hashes: blocks.iter().copied().map(h).collect(),
        medium: Medium::Gpu,
        group_idx: None,
    }
}

fn batch(events: Vec<KvEvent>) -> EventBatch {
    EventBatch {
        ts: 0.0,
        events,
        data_parallel_rank: None,
    }
}

fn ms(t0: Instant, n: u64) -> Instant {
    t0 + Duration::from_millis(n)
}

/// With the defaults one 64-byte text key is one 16-token server block.
fn linker() -> Linker {
    Linker::new(LinkSettings {
        enabled: true,
        ..LinkSettings::default()
    })
}

#[test]
fn key_ends_follow_the_schedule() {
    let s = KeySchedule {
        block_size: 4,
        max_keys: 100,
        dense: 2,
        group: 2,
    };
    let naive = |i: usize| (0..=i).map(|j| s.span(j) as f64).sum::<f64>();
    for i in 0..40 {
        assert_eq!(key_end(&s, i), naive(i), "key {i}");
    }
    let d = KeySchedule::dense(64, 512);
    assert_eq!(key_end(&d, 9), 640.0);
}

#[test]
fn a_first_turn_links_to_a_root_chain_once_it_settled() {
    let mut l = linker();
    let t0 = Instant::now();
    l.decisions(&[decision(1, keys(100, 3))], t0);
    l.events(ep(1), &batch(vec![stored(1..4, None)]), ms(t0, 10));
    assert_eq!(l.counters().decisions_linked, 0, "not settled yet");
    l.tick(ms(t0, 600));
    assert_eq!(l.counters().decisions_linked, 1);
    assert_eq!(l.counters().keys_linked, 3);
    assert_eq!(l.linked_keys(ep(1)), keys(100, 3));
    assert_eq!(l.linked_keys(ep(2)), vec![], "only where it went");
    let e = l.endpoint(ep(1));
    assert_eq!(
        (e.linked_blocks, e.pending_chains, e.pending_decisions),
        (3, 0, 0)
    );
}

#[test]
fn events_before_the_decision_link_too() {
    let mut l = linker();
    let t0 = Instant::now();
    l.events(ep(1), &batch(vec![stored(1..3, None)]), t0);
    l.decisions(&[decision(1, keys(100, 2))], ms(t0, 300));
    l.tick(ms(t0, 600));
    assert_eq!(l.counters().decisions_linked, 1);
    // A chain stored longer than the relay lag before the decision is not its prefill.
    l.events(ep(1), &batch(vec![stored(10..12, None)]), ms(t0, 1_000));
    l.decisions(&[decision(1, keys(200, 2))], ms(t0, 2_000));
    l.tick(ms(t0, 3_000));
    assert_eq!(l.counters().decisions_linked, 1);
}

#[test]
fn a_second_turn_links_under_the_first_turns_last_block() {
    let mut l = linker();
    let t0 = Instant::now();
    l.decisions(&[decision(1, keys(100, 3))], t0);
    l.events(ep(1), &batch(vec![stored(1..4, None)]), ms(t0, 10));
    l.tick(ms(t0, 600));
    // Turn two: the same three keys, then two new ones; its chain hangs under block 3.
    l.events(ep(1), &batch(vec![stored(4..6, Some(3))]), ms(t0, 700));
    l.decisions(&[decision(1, keys(100, 5))], ms(t0, 800));
    l.tick(ms(t0, 1_300));
    assert_eq!(l.counters().decisions_linked, 2);
    assert_eq!(l.counters().keys_linked, 5);
    // The new keys sit on the new blocks: removing block 4 takes keys 3 and 4 only.
    l.events(ep(1), &batch(vec![removed(&[4])]), ms(t0, 2_000));
    let r = l.removals_after(0, 10);
    assert_eq!(r.len(), 1);
    assert_eq!((r[0].endpoint, r[0].keys.clone()), (ep(1), keys(103, 2)));
    assert_eq!(l.linked_keys(ep(1)), keys(100, 3));
}

#[test]
fn a_second_turn_links_through_its_first_turns_decode_block() {
    let mut l = linker();
    let t0 = Instant::now();
    l.decisions(&[decision(1, keys(100, 3))], t0);
    // Prefill, then a block filled by decoding (stored before turn two was routed, but within
    // the relay lag of its arrival).
    l.events(ep(1), &batch(vec![stored(1..4, None)]), ms(t0, 10));
    l.events(ep(1), &batch(vec![stored(4..5, Some(3))]), ms(t0, 20));
    l.tick(ms(t0, 600));
    assert_eq!(l.counters().decisions_linked, 1);
    // Turn two's new text is three blocks: the decode block's one does not fit it, the new
    // chain (under the decode block: its tokens were cached) does.
    l.decisions(&[decision(1, keys(100, 6))], ms(t0, 650));
    l.events(ep(1), &batch(vec![stored(5..7, Some(4))]), ms(t0, 700));
    l.tick(ms(t0, 1_300));
    assert_eq!(l.counters().decisions_linked, 2);
    assert_eq!(l.linked_keys(ep(1)), keys(100, 6));
    assert_eq!(l.endpoint(ep(1)).linked_blocks, 6);
}

#[test]
fn chunked_prefill_links_through_the_first_chunk() {
    let mut l = linker();
    let t0 = Instant::now();
    l.decisions(&[decision(1, keys(100, 6))], t0);
    l.events(ep(1), &batch(vec![stored(1..4, None)]), ms(t0, 10));
    l.events(ep(1), &batch(vec![stored(4..7, Some(3))]), ms(t0, 20));
    l.tick(ms(t0, 600));
    assert_eq!(l.counters().decisions_linked, 1);
    assert_eq!(l.linked_keys(ep(1)), keys(100, 6));
    // Removing block 2 takes keys 1..6: the suffix, across both chunks.
    l.events(ep(1), &batch(vec![removed(&[2])]), ms(t0, 700));
    assert_eq!(l.removals_after(0, 1)[0].keys.len(), 5);
    assert_eq!(l.linked_keys(ep(1)), keys(100, 1));
}

#[test]
fn concurrent_first_turns_of_different_lengths_link_by_length() {
    let mut l = linker();
    let t0 = Instant::now();
    l.decisions(&[decision(1, keys(100, 2)), decision(1, keys(200, 8))], t0);
    l.events(
        ep(1),
        &batch(vec![stored(10..18, None), stored(1..3, None)]),
        ms(t0, 10),
    );
    l.tick(ms(t0, 600));
    assert_eq!(l.counters().decisions_linked, 2);
    l.events(ep(1), &batch(vec![removed(&[11])]), ms(t0, 700));
    let r = l.removals_after(0, 10);
    assert_eq!(
        r[0].keys,
        keys(201, 7),
        "the long prompt's keys after its first"
    );
}

#[test]
fn concurrent_first_turns_of_equal_length_stay_unlinked() {
    let mut l = linker();
    let t0 = Instant::now();
    l.decisions(&[decision(1, keys(100, 4)), decision(1, keys(200, 4))], t0);
    l.events(
        ep(1),
        &batch(vec![stored(1..5, None), stored(10..14, None)]),
        ms(t0, 10),
    );
    l.tick(ms(t0, 600));
    let c = l.counters();
    assert_eq!((c.decisions_linked, c.unlinked_ambiguous), (0, 2));
    assert_eq!(l.linked_keys(ep(1)), vec![]);
    let e = l.endpoint(ep(1));
    assert_eq!(
        (e.pending_decisions, e.pending_chains),
        (0, 2),
        "chains contested"
    );
    // A contested chain never links on its own, even to a decision arriving alone later...
    l.decisions(&[decision(1, keys(300, 4))], ms(t0, 650));
    l.tick(ms(t0, 1_200));
    assert_eq!(l.counters().decisions_linked, 0);
    // ...but the second turn of 200.. links through its first turn's chain: its keys cover
    // both turns' text.
    l.decisions(&[decision(1, keys(200, 6))], ms(t0, 1_300));
    l.events(ep(1), &batch(vec![stored(14..16, Some(13))]), ms(t0, 1_310));
    l.tick(ms(t0, 2_000));
    assert_eq!(l.counters().decisions_linked, 1);
    assert_eq!(l.linked_keys(ep(1)), keys(200, 6));
    l.events(ep(1), &batch(vec![removed(&[12])]), ms(t0, 2_100));
    assert_eq!(l.removals_after(0, 1)[0].keys, keys(202, 4));
}

#[test]
fn a_second_chain_arriving_before_settling_makes_it_ambiguous() {
    let mut l = linker();
    let t0 = Instant::now();
    l.decisions(&[decision(1, keys(100, 4))], t0);
    l.events(ep(1), &batch(vec![stored(1..5, None)]), ms(t0, 10));
    // Another proxy's equal-length first turn: its chain arrives before the first settled.
    l.events(ep(1), &batch(vec![stored(10..14, None)]), ms(t0, 400));
    l.tick(ms(t0, 1_000));
    assert_eq!(l.counters().decisions_linked, 0);
    assert_eq!(l.counters().unlinked_ambiguous, 1);
}

#[test]
fn a_chain_under_another_branch_does_not_link() {
    let mut l = linker();
    let t0 = Instant::now();
    l.decisions(&[decision(1, keys(100, 2)), decision(1, keys(200, 6))], t0);
    l.events(ep(1), &batch(vec![stored(1..3, None)]), ms(t0, 10));
    l.events(ep(1), &batch(vec![stored(10..14, None)]), ms(t0, 10));
    l.tick(ms(t0, 600));
    // 100.. is two keys (fits 1..3); 200.. is six, and 10..14 four blocks: no fit.
    assert_eq!(l.counters().decisions_linked, 1);
    // A continuation of 100.. whose chain hangs under a block no link knows: unlinked.
    l.decisions(&[decision(1, keys(100, 4))], ms(t0, 700));
    l.events(ep(1), &batch(vec![stored(20..22, Some(99))]), ms(t0, 710));
    l.tick(ms(t0, 1_300));
    assert_eq!(l.counters().decisions_linked, 1);
}

#[test]
fn a_removal_of_a_middle_block_removes_exactly_the_suffix() {
    let mut l = linker();
    let t0 = Instant::now();
    l.decisions(&[decision(1, keys(100, 4))], t0);
    l.events(ep(1), &batch(vec![stored(1..5, None)]), ms(t0, 10));
    l.tick(ms(t0, 600));
    // Turn two under block 4; and on another endpoint, the same keys linked separately.
    l.decisions(
        &[decision(1, keys(100, 6)), decision(2, keys(100, 4))],
        ms(t0, 700),
    );
    l.events(ep(1), &batch(vec![stored(5..7, Some(4))]), ms(t0, 710));
    l.events(ep(2), &batch(vec![stored(1..5, None)]), ms(t0, 710));
    l.tick(ms(t0, 1_300));
    assert_eq!(l.counters().decisions_linked, 3);
    l.events(ep(1), &batch(vec![removed(&[3])]), ms(t0, 1_400));
    let r = l.removals_after(0, 10);
    assert_eq!(r.len(), 1);
    let mut got = r[0].keys.clone();
    got.sort();
    assert_eq!((r[0].endpoint, got, r[0].count), (ep(1), keys(102, 4), 4));
    assert_eq!(l.linked_keys(ep(1)), keys(100, 2));
    assert_eq!(
        l.linked_keys(ep(2)),
        keys(100, 4),
        "the other endpoint keeps its own"
    );
    // Removing a block no link holds, or one removed already, records nothing.
    l.events(ep(1), &batch(vec![removed(&[3, 77])]), ms(t0, 1_500));
    assert_eq!(l.removals_after(r[0].seq, 10), vec![]);
    assert_eq!(l.counters().exact_removals, 1);
    assert_eq!(l.counters().keys_removed, 4);
}

#[test]
fn a_proxy_gets_the_removals_after_its_cursor_and_starts_at_the_newest() {
    let mut l = linker();
    let t0 = Instant::now();
    for (i, port) in [1u16, 2, 3].into_iter().enumerate() {
        l.decisions(&[decision(port, keys(100, 2))], ms(t0, i as u64));
        l.events(ep(port), &batch(vec![stored(1..3, None)]), ms(t0, 10));
    }
    l.tick(ms(t0, 600));
    assert_eq!(l.counters().decisions_linked, 3);
    // Nothing removed yet: a fresh proxy (0) is told to ask from record 1.
    assert_eq!(l.removals_for_proxy(0, 10), (vec![], 1));
    l.events(ep(1), &batch(vec![removed(&[2])]), ms(t0, 700));
    l.events(ep(2), &batch(vec![removed(&[1])]), ms(t0, 700));
    // That proxy gets both, oldest first, a page at a time.
    let (page, next) = l.removals_for_proxy(1, 1);
    assert_eq!((page.len(), page[0].endpoint, next), (1, ep(1), 2));
    let (page, next) = l.removals_for_proxy(next, 10);
    assert_eq!((page.len(), page[0].endpoint, next), (1, ep(2), 3));
    assert_eq!(l.removals_for_proxy(3, 10), (vec![], 3));
    // A proxy that starts now begins after them.
    assert_eq!(l.removals_for_proxy(0, 10), (vec![], 3));
    // A cursor beyond the numbering (this aggregator restarted): every record held.
    let (page, next) = l.removals_for_proxy(99, 1);
    assert_eq!((page.len(), page[0].endpoint, next), (1, ep(1), 2));
}

#[test]
fn clearing_removes_every_key_of_the_endpoint() {
    let mut l = linker();
    let t0 = Instant::now();
    l.decisions(&[decision(1, keys(100, 3))], t0);
    l.events(ep(1), &batch(vec![stored(1..4, None)]), ms(t0, 10));
    l.tick(ms(t0, 600));
    l.events(ep(1), &batch(vec![KvEvent::AllBlocksCleared]), ms(t0, 700));
    let r = l.removals_after(0, 10);
    assert_eq!(r.len(), 1);
    assert!(r[0].cleared);
    let mut got = r[0].keys.clone();
    got.sort();
    assert_eq!(got, keys(100, 3));
    assert_eq!(l.endpoint(ep(1)), EndpointLinks::default());
    // Cleared with nothing linked: no record.
    l.clear(ep(1));
    assert_eq!(l.removals_after(r[0].seq, 10), vec![]);
}

#[test]
fn unmatched_decisions_and_chains_age_out() {
    let mut l = linker();
    let t0 = Instant::now();
    l.decisions(&[decision(1, keys(100, 3))], t0);
    l.events(ep(1), &batch(vec![stored(1..9, None)]), ms(t0, 10));
    l.tick(ms(t0, 9_000));
    assert_eq!(l.endpoint(ep(1)).pending_decisions, 1);
    l.tick(ms(t0, 10_500));
    let c = l.counters();
    assert_eq!((c.unlinked_no_chain, c.chains_expired), (1, 1));
    assert_eq!(l.endpoint(ep(1)), EndpointLinks::default());
    // A chain that fits, after the decision expired, links nothing.
    l.events(ep(1), &batch(vec![stored(20..23, None)]), ms(t0, 10_600));
    l.tick(ms(t0, 11_500));
    assert_eq!(l.counters().decisions_linked, 0);
}

#[test]
fn pending_lists_and_links_are_capped() {
    let mut l = Linker::new(LinkSettings {
        enabled: true,
        max_pending_decisions: 2,
        max_pending_chains: 2,
        max_linked_blocks: 3,
        ..LinkSettings::default()
    });
    let t0 = Instant::now();
    l.decisions(
        &[
            decision(1, keys(100, 5)),
            decision(1, keys(200, 6)),
            decision(1, keys(300, 2)),
        ],
        t0,
    );
    assert_eq!(l.counters().unlinked_capacity, 1, "the oldest dropped");
    assert_eq!(l.endpoint(ep(1)).pending_decisions, 2);
    l.events(
        ep(1),
        &batch(vec![
            stored(10..15, None),
            stored(20..26, None),
            stored(1..3, None),
        ]),
        ms(t0, 10),
    );
    assert_eq!(l.endpoint(ep(1)).pending_chains, 2);
    l.tick(ms(t0, 600));
    // 300.. links (two blocks); 200.. would take six more, past the cap of three.
    let c = l.counters();
    assert_eq!((c.decisions_linked, c.unlinked_capacity), (1, 2));
    assert_eq!(l.endpoint(ep(1)).linked_blocks, 2);
}

#[test]
fn known_prompts_and_other_media_and_bad_stores_are_ignored() {
    let mut l = linker();
    let t0 = Instant::now();
    l.decisions(&[decision(1, keys(100, 2))], t0);
    l.events(ep(1), &batch(vec![stored(1..3, None)]), ms(t0, 10));
    l.tick(ms(t0, 600));
    l.decisions(
        &[decision(1, keys(100, 2)), decision(1, vec![])],
        ms(t0, 700),
    );
    assert_eq!(l.counters().decisions_known, 1);
    // A decision relayed twice while pending is one decision, not two rivals.
    l.decisions(
        &[decision(1, keys(300, 1)), decision(1, keys(300, 1))],
        ms(t0, 700),
    );
    assert_eq!(l.counters().decisions_repeated, 1);
    l.events(ep(1), &batch(vec![stored(30..31, None)]), ms(t0, 710));
    l.tick(ms(t0, 1_300));
    assert_eq!(l.counters().decisions_linked, 2);
    assert_eq!(l.endpoint(ep(1)).pending_decisions, 0);
    let cpu = KvEvent::BlockStored {
        block_hashes: vec![h(50)],
        parent_block_hash: None,
        token_ids: vec![],
        block_size: BS,
        lora_id: None,
        medium: Medium::Cpu,
        lora_name: None,
        group_idx: None,
    };
    let short = KvEvent::BlockStored {
        block_hashes: vec![h(51), h(52)],
        parent_block_hash: None,
        token_ids: vec![1; 20],
        block_size: BS,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: None,
        group_idx: None,
    };
    let cpu_removed = KvEvent::BlockRemoved {
        block_hashes: vec![h(1)],
        medium: Medium::Cpu,
        group_idx: None,
    };
    l.events(ep(1), &batch(vec![cpu, short, cpu_removed]), ms(t0, 1_400));
    assert_eq!(l.endpoint(ep(1)).pending_chains, 0);
    assert_eq!(
        l.linked_keys(ep(1)),
        vec![BlockKey(100), BlockKey(101), BlockKey(300)]
    );
}

/// A table against a naive reference: single first turns of 1..40 keys on their own
/// endpoints, each with its chain of the right length, always link, and every key lands on the
/// block of the same index.
#[test]
fn single_first_turns_link_key_i_to_block_i() {
    let mut l = linker();
    let t0 = Instant::now();
    for n in 1..40u64 {
        let port = n as u16;
        l.decisions(&[decision(port, keys(n * 1000, n))], t0);
        let base = n * 1000;
        l.events(
            ep(port),
            &batch(vec![stored(base..base + n, None)]),
            ms(t0, 5),
        );
    }
    l.tick(ms(t0, 600));
    assert_eq!(l.counters().decisions_linked, 39);
    for n in 1..40u64 {
        let base = n * 1000;
        let middle = n / 2;
        l.events(
            ep(n as u16),
            &batch(vec![removed(&[base + middle])]),
            ms(t0, 700),
        );
        let last = l
            .removals_after(0, 100)
            .pop()
            .unwrap_or_else(|| panic!("n {n}"));
        // Naive: key i is in block i, so removing block m takes keys m..n.
        let mut got = last.keys.clone();
        got.sort();
        assert_eq!(got, keys(base + middle, n - middle), "n {n}");
    }
}

#[test]
fn a_later_turn_waits_for_its_earlier_turn_relayed_together() {
    let mut l = linker();
    let t0 = Instant::now();
    // Both turns' decisions and chains pending at once (a relay batch carrying both): the
    // second turn, still root-anchored, must not claim the first turn's chain.
    l.decisions(
        &[decision(1, keys(100, 20)), decision(1, keys(100, 21))],
        t0,
    );
    l.events(
        ep(1),
        &batch(vec![stored(1..21, None), stored(21..22, Some(20))]),
        ms(t0, 10),
    );
    l.tick(ms(t0, 600));
    let c = l.counters();
    assert_eq!((c.decisions_linked, c.unlinked_ambiguous), (2, 0));
    assert_eq!(l.linked_keys(ep(1)), keys(100, 21));
}

/// Two conversations whose turns have equal lengths, on one endpoint, all within the relay
/// lag: every turn is ambiguous (nothing tells them apart), none waits forever.
#[test]
fn equal_length_conversations_stay_ambiguous_turn_after_turn() {
    let mut l = linker();
    let t0 = Instant::now();
    // Conversation a: keys 100.., blocks 1..; conversation b: keys 200.., blocks 101...
    let mut at = 0;
    for turn in 0..3u64 {
        let n = 4 + 2 * turn;
        l.decisions(
            &[decision(1, keys(100, n)), decision(1, keys(200, n))],
            ms(t0, at),
        );
        let (from, to) = (if turn == 0 { 0 } else { 4 + 2 * (turn - 1) }, n);
        let parent = |base: u64| (turn > 0).then_some(base + from);
        l.events(
            ep(1),
            &batch(vec![
                stored(1 + from..1 + to, parent(0)),
                stored(101 + from..101 + to, parent(100)),
            ]),
            ms(t0, at + 10),
        );
        at += 700;
        l.tick(ms(t0, at));
    }
    let c = l.counters();
    assert_eq!((c.decisions_linked, c.unlinked_ambiguous), (0, 6), "{c:?}");
}

/// An ambiguous turn whose rivals' next-turn chains already arrived (they fit its tail too)
/// leaves those chains to the next turns' decisions.
#[test]
fn an_ambiguous_turn_leaves_the_next_turns_chains_alone() {
    let mut l = linker();
    let t0 = Instant::now();
    l.decisions(&[decision(1, keys(100, 4)), decision(1, keys(200, 4))], t0);
    l.events(
        ep(1),
        &batch(vec![stored(1..5, None), stored(101..105, None)]),
        ms(t0, 10),
    );
    // The next turns (one key more each), routed and stored before the first turns settled.
    l.events(
        ep(1),
        &batch(vec![stored(5..6, Some(4)), stored(105..106, Some(104))]),
        ms(t0, 20),
    );
    l.decisions(
        &[decision(1, keys(100, 5)), decision(1, keys(200, 5))],
        ms(t0, 100),
    );
    l.tick(ms(t0, 600));
    // Both turns ambiguous (one length for both conversations), none left waiting for a chain
    // the first turns' ambiguity took.
    let c = l.counters();
    assert_eq!((c.unlinked_ambiguous, c.decisions_linked), (4, 0), "{c:?}");
    assert_eq!(l.endpoint(ep(1)).pending_decisions, 0);
}

#[test]
fn full_pending_lists_cost_little_per_tick() {
    // The case that stalled the aggregator's pool task: both lists full of entries that never
    // fit each other (4-block prompts, 10-block chains), every tick.
    let mut l = linker();
    let t0 = Instant::now();
    let decisions: Vec<_> = (0..256u64)
        .map(|i| decision(1, keys(10_000 + i * 10, 4)))
        .collect();
    l.decisions(&decisions, t0);
    for i in 0..1024u64 {
        l.events(ep(1), &batch(vec![stored(i * 100..i * 100 + 10, None)]), t0);
    }
    let started = std::time::Instant::now();
    for t in 1..=100 {
        l.tick(ms(t0, 500 + t));
    }
    let spent = started.elapsed();
    let s = l.endpoint(ep(1));
    assert_eq!((s.pending_decisions, s.pending_chains), (256, 1024));
    assert_eq!(l.counters().decisions_linked, 0);
    // Each tick matches 256 decisions against 1,024 chains by a lookup of their predicted
    // end (the matching before tried every pair, on every batch).
    assert!(spent < Duration::from_secs(2), "100 ticks took {spent:?}");
}

#[test]
fn a_burst_of_first_turns_links_over_a_few_ticks() {
    let mut l = Linker::new(LinkSettings {
        enabled: true,
        max_matches_per_tick: 4,
        match_interval: Duration::ZERO,
        ..LinkSettings::default()
    });
    let t0 = Instant::now();
    // 12 first turns whose lengths (2 to 115 blocks) are farther apart than a prediction's
    // window (a block, and 10% of the length), and their chains.
    let lens = [2u64, 4, 6, 9, 13, 18, 25, 34, 46, 62, 84, 115];
    let decisions: Vec<_> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| decision(1, keys(1_000 * (i as u64 + 1), n)))
        .collect();
    l.decisions(&decisions, t0);
    for (i, &n) in lens.iter().enumerate() {
        let first = 100_000 * (i as u64 + 1);
        l.events(
            ep(1),
            &batch(vec![stored(first..first + n, None)]),
            ms(t0, 10),
        );
    }
    // One tick links at most its budget; the rest follow on the next ticks.
    l.tick(ms(t0, 600));
    assert_eq!(l.counters().decisions_linked, 4);
    l.tick(ms(t0, 625));
    assert_eq!(l.counters().decisions_linked, 8);
    l.tick(ms(t0, 650));
    let c = l.counters();
    assert_eq!((c.decisions_linked, c.unlinked_ambiguous), (12, 0));
}

#[test]
fn many_concurrent_prompts_of_one_length_are_dropped_as_ambiguous_in_one_tick() {
    let mut l = linker();
    let t0 = Instant::now();
    // 40 first turns of 4 blocks and 40 chains of 4 blocks: each decision fits every chain.
    let decisions: Vec<_> = (0..40u64)
        .map(|i| decision(1, keys(10_000 + i * 10, 4)))
        .collect();
    l.decisions(&decisions, t0);
    for i in 0..40u64 {
        l.events(
            ep(1),
            &batch(vec![stored(i * 100..i * 100 + 4, None)]),
            ms(t0, 10),
        );
    }
    l.tick(ms(t0, 600));
    let c = l.counters();
    assert_eq!((c.decisions_linked, c.unlinked_ambiguous), (0, 40));
    assert_eq!(l.endpoint(ep(1)).pending_decisions, 0);
    // Two more of that length, relayed just after the chains: still ambiguous (the chains are
    // contested and each other's rival).
    l.decisions(
        &[decision(1, keys(90_000, 4)), decision(1, keys(91_000, 4))],
        ms(t0, 20),
    );
    l.tick(ms(t0, 700));
    assert_eq!(l.counters().decisions_linked, 0);
}

fn on_tier(stored: bool, blocks: &[u64], medium: Medium) -> KvEvent {
    let block_hashes = blocks.iter().copied().map(h).collect();
    if stored {
        // As vLLM's offloading connector sends it: no parent, no token ids.
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash: None,
            token_ids: vec![],
            block_size: 0,
            lora_id: None,
            medium,
            lora_name: None,
            group_idx: None,
        }
    } else {
        KvEvent::BlockRemoved {
            block_hashes,
            medium,
            group_idx: None,
        }
    }
}

/// What the records after `seq` say, keys sorted: (fate, keys).
fn fates(l: &Linker, seq: u64) -> Vec<(Option<Tier>, Vec<BlockKey>)> {
    l.removals_after(seq, 100)
        .into_iter()
        .map(|r| {
            let mut k = r.keys;
            k.sort();
            (r.offloaded_to, k)
        })
        .collect()
}

#[test]
fn a_block_evicted_from_the_gpu_with_a_cpu_copy_is_offloaded_not_removed() {
    let mut l = linker();
    let t0 = Instant::now();
    // A four-block first turn, written through to CPU memory as it was stored (blocks 1-4),
    // and to storage as well (blocks 1-2).
    l.decisions(&[decision(1, keys(100, 4))], t0);
    l.events(
        ep(1),
        &batch(vec![
            stored(1..5, None),
            on_tier(true, &[1, 2, 3, 4], Medium::Cpu),
            on_tier(true, &[1, 2], Medium::Storage),
        ]),
        ms(t0, 10),
    );
    l.tick(ms(t0, 600));
    assert_eq!(l.counters().decisions_linked, 1);
    // The GPU evicts the tail first: block 4, then 3; each moves to CPU memory, keys linked.
    l.events(
        ep(1),
        &batch(vec![removed(&[4]), removed(&[3])]),
        ms(t0, 700),
    );
    assert_eq!(
        fates(&l, 0),
        vec![
            (Some(Tier::Cpu), keys(103, 1)),
            (Some(Tier::Cpu), keys(102, 1)),
        ]
    );
    assert_eq!(l.linked_keys(ep(1)), keys(100, 4));
    let c = l.counters();
    assert_eq!((c.offloads, c.keys_offloaded, c.exact_removals), (2, 2, 0));
    // Block 3's CPU copy goes (no storage copy): it and block 4 below it are removed.
    l.events(
        ep(1),
        &batch(vec![on_tier(false, &[3], Medium::Cpu)]),
        ms(t0, 800),
    );
    assert_eq!(fates(&l, 2), vec![(None, keys(102, 2))]);
    assert_eq!(l.linked_keys(ep(1)), keys(100, 2));
    // Block 1 leaves the GPU: blocks 1 and 2 are offloaded, to CPU memory, in one record.
    l.events(ep(1), &batch(vec![removed(&[1])]), ms(t0, 900));
    assert_eq!(fates(&l, 3), vec![(Some(Tier::Cpu), keys(100, 2))]);
    // Their CPU copies go, the storage copies stay: they move down to storage.
    l.events(
        ep(1),
        &batch(vec![on_tier(false, &[1, 2], Medium::Cpu)]),
        ms(t0, 1_000),
    );
    assert_eq!(fates(&l, 4), vec![(Some(Tier::Storage), keys(100, 2))]);
    assert_eq!(l.linked_keys(ep(1)), keys(100, 2));
    // A CPU copy that goes while the block is on the GPU changes nothing.
    let before = l.removals_after(0, 100).len();
    l.events(
        ep(2),
        &batch(vec![on_tier(false, &[1], Medium::Cpu)]),
        ms(t0, 1_100),
    );
    assert_eq!(l.removals_after(0, 100).len(), before);
}

#[test]
fn a_prefix_loaded_back_from_cpu_is_on_the_gpu_again_and_the_next_turn_links_under_it() {
    let mut l = linker();
    let t0 = Instant::now();
    l.decisions(&[decision(1, keys(100, 3))], t0);
    l.events(
        ep(1),
        &batch(vec![
            stored(1..4, None),
            on_tier(true, &[1, 2, 3], Medium::Cpu),
        ]),
        ms(t0, 10),
    );
    l.tick(ms(t0, 600));
    l.events(ep(1), &batch(vec![removed(&[1])]), ms(t0, 700));
    assert_eq!(fates(&l, 0), vec![(Some(Tier::Cpu), keys(100, 3))]);
    // The next turn: the server loads blocks 1-3 back and prefills two more, stored in one
    // event (the loaded blocks first).
    l.decisions(&[decision(1, keys(100, 5))], ms(t0, 800));
    l.events(ep(1), &batch(vec![stored(1..6, None)]), ms(t0, 810));
    l.tick(ms(t0, 1_500));
    assert_eq!(l.counters().decisions_linked, 2);
    assert_eq!(l.linked_keys(ep(1)), keys(100, 5));
    // Back on the GPU: evicting block 1 from it offloads the whole prompt again (its CPU copies
    // still there for 1-3; 4 and 5 have none, so they go).
    l.events(ep(1), &batch(vec![removed(&[1])]), ms(t0, 1_600));
    assert_eq!(
        fates(&l, 1),
        vec![(None, keys(103, 2)), (Some(Tier::Cpu), keys(100, 3))]
    );
}

fn timed(port: u16, keys: Vec<BlockKey>, routed_s: f64) -> RelayedDecision {
    RelayedDecision {
        routed_at_ms: Some((routed_s * 1000.0) as u64),
        ..decision(port, keys)
    }
}

fn batch_at(ts: f64, events: Vec<KvEvent>) -> EventBatch {
    EventBatch {
        ts,
        events,
        data_parallel_rank: None,
    }
}

#[test]
fn first_turns_of_equal_length_served_one_after_another_link_by_their_routing_times() {
    let mut l = linker();
    let t0 = Instant::now();
    // Three prompts of four blocks, routed 200 ms apart, each stored 20 ms after it was
    // routed; all relayed together, their chains arriving within the relay lag.
    l.decisions(
        &[
            timed(1, keys(100, 4), 1000.0),
            timed(1, keys(200, 4), 1000.2),
            timed(1, keys(300, 4), 1000.4),
        ],
        t0,
    );
    l.events(
        ep(1),
        &batch_at(1000.02, vec![stored(1..5, None)]),
        ms(t0, 10),
    );
    l.events(
        ep(1),
        &batch_at(1000.22, vec![stored(10..14, None)]),
        ms(t0, 20),
    );
    l.events(
        ep(1),
        &batch_at(1000.42, vec![stored(20..24, None)]),
        ms(t0, 30),
    );
    for t in [600, 700, 800] {
        l.tick(ms(t0, t));
    }
    let c = l.counters();
    assert_eq!((c.decisions_linked, c.unlinked_ambiguous), (3, 0));
    // Each to its own chain: removing the second chain's head removes the second prompt only.
    l.events(ep(1), &batch(vec![removed(&[10])]), ms(t0, 900));
    assert_eq!(l.removals_after(0, 10)[0].keys, keys(200, 4));
    assert_eq!(l.linked_keys(ep(1)).len(), 8);
}

#[test]
fn first_turns_of_equal_length_routed_together_stay_ambiguous_even_with_times() {
    let mut l = linker();
    let t0 = Instant::now();
    // Routed 10 ms apart, both stored after both were routed: either chain may be either's.
    l.decisions(
        &[
            timed(1, keys(100, 4), 1000.0),
            timed(1, keys(200, 4), 1000.01),
        ],
        t0,
    );
    l.events(
        ep(1),
        &batch_at(1000.1, vec![stored(1..5, None), stored(10..14, None)]),
        ms(t0, 10),
    );
    l.tick(ms(t0, 600));
    let c = l.counters();
    assert_eq!((c.decisions_linked, c.unlinked_ambiguous), (0, 2));
    // A chain stored before a decision was routed is not its prefill, whatever its length.
    l.decisions(&[timed(1, keys(300, 4), 2000.0)], ms(t0, 700));
    l.events(
        ep(1),
        &batch_at(1999.0, vec![stored(30..34, None)]),
        ms(t0, 710),
    );
    l.tick(ms(t0, 1_400));
    assert_eq!(l.counters().decisions_linked, 0);
}
