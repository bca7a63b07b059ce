//! Step timing of the simulated engine: Dynamo mocker's analytic perf model
//! (`lib/mocker/src/common/perf_model.rs`, routing-and-disagg.md §9) and a virtual clock that
//! keeps sub-millisecond steps accurate on average despite tokio's 1 ms timer resolution.

use std::time::{Duration, Instant};

/// Prefill time in ms for `tokens` uncached prompt tokens computed in one step (0 → 0 ms).
pub fn prefill_ms(tokens: u64) -> f64 {
    if tokens == 0 {
        return 0.0;
    }
    let t = tokens as f64;
    4.209989e-07 * t * t + 1.518344e-02 * t + 16.50142
}

/// Decode time in ms of one step at KV utilisation `u` = active KV tokens / total KV tokens.
pub fn decode_ms(utilisation: f64) -> f64 {
    let u = utilisation.clamp(0.0, 1.0);
    (-25.74 * u * u + 54.01 * u + 5.74).max(1.0)
}

/// Simulated duration of one scheduler step: the prefill cost of its prefill tokens plus, when
/// it also decodes, one decode pass; all divided by `speedup` (≤ 0 or NaN counts as 1).
pub fn step_duration(
    prefill_tokens: u64,
    decodes: bool,
    utilisation: f64,
    speedup: f64,
) -> Duration {
    let mut ms = prefill_ms(prefill_tokens);
    if decodes {
        ms += decode_ms(utilisation);
    }
    let speedup = if speedup.is_finite() && speedup > 0.0 {
        speedup
    } else {
        1.0
    };
    Duration::from_secs_f64(ms / speedup / 1000.0)
}

/// A simulated clock that runs ahead of the wall clock by whole steps and sleeps only when the
/// lead exceeds the timer resolution, so thousands of microsecond steps cost their true total
/// time instead of a millisecond each.
#[derive(Debug)]
pub struct VirtualClock {
    sim_now: Instant,
}

/// The largest lag (simulated behind wall time) the clock carries over; beyond it (e.g. after
/// idling) the clock resynchronises instead of bursting to catch up.
const MAX_LAG: Duration = Duration::from_millis(2);

impl Default for VirtualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl VirtualClock {
    pub fn new() -> Self {
        VirtualClock {
            sim_now: Instant::now(),
        }
    }

    /// Advances simulated time by `step` and waits until wall time catches up with it.
    pub async fn advance(&mut self, step: Duration) {
        let now = Instant::now();
        if now.saturating_duration_since(self.sim_now) > MAX_LAG {
            self.sim_now = now;
        }
        self.sim_now += step;
        if self.sim_now > now + Duration::from_micros(500) {
            tokio::time::sleep_until(self.sim_now.into()).await;
        } else {
            // Still yield so other tasks (submitters, gRPC streams) make progress.
            tokio::task::yield_now().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mocker_formulas() {
        assert_eq!(prefill_ms(0), 0.0);
        let p1000 = prefill_ms(1000);
        assert!((p1000 - (0.4209989 + 15.18344 + 16.50142)).abs() < 1e-9);
        assert!(prefill_ms(2000) > p1000);
        assert!((decode_ms(0.0) - 5.74).abs() < 1e-12);
        assert!((decode_ms(0.5) - (-25.74 * 0.25 + 27.005 + 5.74)).abs() < 1e-9);
        assert!(decode_ms(1.0) >= 1.0);
    }

    #[test]
    fn speedup_divides() {
        let slow = step_duration(1000, true, 0.3, 1.0);
        let fast = step_duration(1000, true, 0.3, 100.0);
        let ratio = slow.as_secs_f64() / fast.as_secs_f64();
        assert!((ratio - 100.0).abs() < 1e-3, "{ratio}");
        assert_eq!(step_duration(0, false, 0.0, 1.0), Duration::ZERO);
        assert_eq!(
            step_duration(10, false, 0.0, 0.0),
            step_duration(10, false, 0.0, 1.0)
        );
    }

    #[tokio::test]
    async fn virtual_clock_accumulates_small_steps() {
        let mut clock = VirtualClock::new();
        let start = Instant::now();
        for _ in 0..200 {
            clock.advance(Duration::from_micros(100)).await;
        }
        let took = start.elapsed();
        // 20 ms of simulated time: not 200 ms (one timer tick per step), not instant.
        assert!(took >= Duration::from_millis(17), "{took:?}");
        assert!(took < Duration::from_millis(120), "{took:?}");
    }
}
