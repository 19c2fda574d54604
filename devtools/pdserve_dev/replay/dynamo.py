"""NVIDIA Dynamo's SLA planner as a replay policy (`dynamo-planner`), rebuilt from its published source.

Sources (ai-dynamo/dynamo, `components/src/dynamo/planner/`, read in 2026 at the commits named; Dynamo v1.x with
`optimization_target: sla`, the planner mode that targets TTFT/ITL; docs: "Planner Guide" and "Planner Design",
docs.nvidia.com/dynamo v1.0-v1.2):

- `core/state_machine.py` (0272cbdd): each tick runs the load path first, then the throughput path; with both
  enabled the throughput path only sets per-pool lower bounds, it never scales by itself.
- `core/throughput_scaling.py` (0c9050c9): predict the next interval's request count, ISL and OSL;
  prefill replicas = max(ceil(demand_rps x wall_time(ISL)), ceil(wall_time(ISL) / TTFT SLA) when one prefill
  alone misses the SLA, min_endpoint), i.e. demand over the engine's request rate 1 / wall_time(ISL)
  (`perf_model/prefill.py` `find_best_engine_prefill_rps`, 4d3f6720: a prompt longer than the batch budget costs
  ceil(ISL / budget) passes); decode replicas = ceil(demand_rps / engine_rps) where engine_rps =
  best_batch / (OSL x wall_time(best_batch)) and best_batch is the largest batch, at context ISL + OSL / 2 and
  within the KV cache and max_num_seqs, whose step time stays within the ITL SLA (`perf_model/decode.py`
  `find_best_engine_decode_rps`, 439d6458).
- `core/load_scaling.py` (0c6da1ec and a later revision that adds the disagg scaling-in-progress guard):
  while either pool has replicas starting, observe only. Per pool, estimate every engine's TTFT (prefill:
  its queued prompt tokens plus the mean ISL, chunked by the batch budget, each chunk's step time summed) or ITL
  (decode: one step with the engine's scheduled and queued requests and KV plus one average request); +1 replica
  only when every engine's estimate is over the SLA (`_scale_decision`); otherwise -1 only when the
  consolidation check passes on every engine: with the load of N engines on N - 1 (queue or KV x N / (N - 1)),
  prefill's queue-induced TTFT (estimate minus the request's own compute) must stay under
  (SLA - own compute) x sensitivity, and decode's KV must fit the cache and its ITL stay under SLA x sensitivity.
  The result is raised to the throughput lower bound, then to min_endpoint.
- `core/load/predictors.py` (260b6ae9) and `config/defaults.py` (1ca60155): the default predictor is ARIMA
  (pmdarima's auto_arima, fitted once after 5 points then only updated, refitted in log1p space when the raw fit
  collapses to (0, d, 0)); leading zeros are skipped; throughput interval 180 s, load interval 5 s, scale-down
  sensitivity 80%.

Simplified here (each says why):
- The performance model starts from the benchmark's engine profile (`EngineProfile`, the simulator's cost model)
  in place of Dynamo's pre-deployment profiling: every policy gets the same knowledge of the engine. Decode keeps
  Dynamo's online regression on the engines' passes (`DecodeRegression`, after `perf_model/base.py`), since the
  replay's decode passes cost more than the profile's pure decode pass; prefill passes are exactly the profile's.
- The load path runs on the replay's control tick (15 s) instead of every 5 s; every policy shares the tick.
- The moving averages Dynamo keeps over 64 forward passes (mean ISL, mean decode length) are the prefill pool's
  mean prompt over the collector's window and the decode engines' mean context at the tick, each averaged over
  the last 64 samples; the regression learns one pass per decode engine per tick (the latest).
- ARIMA is `ArimaPredictor` below: d by the KPSS test as auto_arima does, then AR orders 0-2 by AIC (no MA
  terms), fitted by least squares and refitted on the whole history each interval with the order kept, the
  log1p fallback as in Dynamo. pmdarima and its MLE fit are not available here.
- No GPU budget (Dynamo's default is 8 GPUs): the benchmark's per-pool bounds stand in for min_endpoint and the
  budget, as for every policy. No prefix-cache discount (the replay has no prefix hits), no speculative decoding.
- Throughput demand counts every request, as Dynamo's frontend metrics do, although the replay's router sends
  prompts shorter than the PD threshold straight to decode.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence

from pdserve_dev.replay.observe import EngineSample, FrontendTotals, Observation
from pdserve_operator.autoscaler.model import EngineProfile
from pdserve_operator.autoscaler.policy import PolicyConfig
from pdserve_operator.autoscaler.signals import Role

#: Dynamo's `SLAPlannerDefaults`.
THROUGHPUT_INTERVAL_S = 180.0
SCALE_DOWN_SENSITIVITY = 0.80
MOVING_AVERAGE_SAMPLES = 64
#: KPSS level-stationarity critical value at 5% (Kwiatkowski et al. 1992), auto_arima's default test and alpha.
KPSS_CRITICAL_5PCT = 0.463


# ----------------------------------------------------------------------------------------------- predictors


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular (a constant regressor, too few points)."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def _diff(y: Sequence[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(y)]


def _kpss_stationary(y: Sequence[float]) -> bool:
    """KPSS test of level stationarity at 5%, with the Newey-West long-run variance and pmdarima's short lag."""
    n = len(y)
    if n < 3:
        return True
    mean = sum(y) / n
    e = [v - mean for v in y]
    lags = int(3 * math.sqrt(n) / 13)
    s2 = sum(v * v for v in e) / n
    for lag in range(1, lags + 1):
        s2 += 2 * (1 - lag / (lags + 1)) * sum(e[t] * e[t - lag] for t in range(lag, n)) / n
    if s2 <= 0:
        return True
    partial, stat = 0.0, 0.0
    for v in e:
        partial += v
        stat += partial * partial
    return stat / (n * n * s2) < KPSS_CRITICAL_5PCT


def _fit_ar(z: Sequence[float], p: int, intercept: bool, skip: int) -> tuple[list[float], float] | None:
    """Least-squares AR(p) on `z` from index `skip` (the same sample for every order compared): (coefficients,
    residual sum of squares), the intercept first when fitted."""
    rows = [([1.0] if intercept else []) + [z[t - i] for i in range(1, p + 1)] for t in range(skip, len(z))]
    targets = list(z[skip:])
    k = p + (1 if intercept else 0)
    if k == 0:
        return [], sum(v * v for v in targets)
    if len(targets) <= k:
        return None
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    atb = [sum(r[i] * t for r, t in zip(rows, targets, strict=True)) for i in range(k)]
    coef = _solve(ata, atb)
    if coef is None:
        return None
    rss = sum((t - sum(c * x for c, x in zip(coef, r, strict=True))) ** 2 for r, t in zip(rows, targets, strict=True))
    return coef, rss


def _select_order(y: Sequence[float], max_p: int = 2) -> tuple[int, int]:
    """(p, d): d from repeated KPSS tests (at most 2), then the AR order with the lowest AIC."""
    d, z = 0, list(y)
    while d < 2 and len(z) > 3 and not _kpss_stationary(z):
        z, d = _diff(z), d + 1
    intercept = d < 2
    best, best_aic = 0, math.inf
    skip = min(max_p, max(len(z) - 3, 0))
    for p in range(0, max_p + 1):
        if p > skip:
            break
        fit = _fit_ar(z, p, intercept, skip)
        if fit is None:
            continue
        n = len(z) - skip
        aic = n * math.log(max(fit[1] / n, 1e-12)) + 2 * (p + int(intercept) + 1)
        if aic < best_aic - 1e-9:
            best, best_aic = p, aic
    return best, d


def _forecast(y: Sequence[float], p: int, d: int) -> float:
    """One step ahead of ARIMA(p, d, 0) refitted on all of `y` (with a constant / drift when d < 2)."""
    z = list(y)
    for _ in range(d):
        z = _diff(z)
    fit = _fit_ar(z, p, d < 2, p) if len(z) > p else None
    if fit is None:
        step = sum(z) / len(z) if z and d < 2 else 0.0
    else:
        coef = fit[0]
        x = ([1.0] if d < 2 else []) + [z[-i] for i in range(1, p + 1)]
        step = sum(c * v for c, v in zip(coef, x, strict=True))
    if d == 0:
        return step
    if d == 1:
        return y[-1] + step
    return y[-1] + (y[-1] - y[-2]) + step


class ArimaPredictor:
    """Dynamo's default load predictor (`ARIMAPredictor`), in the simplified form the module docstring gives."""

    minimum_points = 5

    def __init__(self) -> None:
        self.values: list[float] = []
        self._seen_nonzero = False
        self.order: tuple[int, int] | None = None
        self.log1p = False

    def add(self, value: float) -> None:
        """One interval's observation; the idle stretch before the first non-zero one is skipped."""
        if not math.isfinite(value):
            value = 0.0
        if value == 0 and not self._seen_nonzero:
            return
        self._seen_nonzero = self._seen_nonzero or value != 0
        self.values.append(max(0.0, value))

    def predict(self) -> float:
        """The next interval's value: the last one until 5 are known, a constant series as itself, else the
        ARIMA forecast (never negative)."""
        values = self.values
        if len(values) < self.minimum_points:
            return values[-1] if values else 0.0
        if len(set(values)) == 1:
            return values[0]
        if self.order is None:
            # Fitted once; Dynamo then only updates the parameters of that order with new points.
            self.order = _select_order(values)
            if self.order[0] == 0:
                # Collapsed to (0, d, 0): Dynamo refits in log1p space to handle spiky series.
                self.log1p = True
                self.order = _select_order([math.log1p(v) for v in values])
        series = [math.log1p(v) for v in values] if self.log1p else values
        forecast = _forecast(series, *self.order)
        return max(0.0, math.expm1(forecast) if self.log1p else forecast)


class _MovingAverage:
    """Mean of the last `size` non-zero-led samples (Dynamo's `_MovingAverage`)."""

    def __init__(self, size: int = MOVING_AVERAGE_SAMPLES) -> None:
        self._window: deque[float] = deque(maxlen=size)

    def add(self, value: float) -> None:
        if value == 0 and not self._window:
            return
        self._window.append(value)

    @property
    def value(self) -> float:
        return sum(self._window) / len(self._window) if self._window else 0.0


# ------------------------------------------------------------------------------------------ performance model


#: The profile's sweep that bootstraps the decode regression: batch sizes x context per sequence.
SWEEP_BATCHES = (1, 16, 64, 128, 256)
SWEEP_CONTEXTS = (256, 1024, 4096)


class PerfModel:
    """Pass times of the engines: prefill from the benchmark's profile (the replay's prefill passes are exactly
    linear in their tokens, so Dynamo's 1-D regression would fit the profile itself), decode from a
    `DecodeRegression` bootstrapped from the profile and taught by live passes."""

    def __init__(self, prefill: EngineProfile, decode: EngineProfile) -> None:
        self.prefill = prefill
        self.decode = decode
        self.decode_fit = DecodeRegression()
        for batch in SWEEP_BATCHES:
            for context in SWEEP_CONTEXTS:
                self.decode_fit.add(batch, batch * context, self.profile_decode_pass_s(batch, batch * context))

    def prefill_pass_s(self, tokens: float) -> float:
        p = self.prefill
        return p.step_overhead_s + p.prefill_fixed_s + p.prefill_per_token_s * tokens

    def profile_decode_pass_s(self, requests: float, kv_tokens: float) -> float:
        d = self.decode
        return d.step_overhead_s + d.decode_per_seq_s * requests + d.decode_per_context_token_s * kv_tokens

    def decode_pass_s(self, requests: float, kv_tokens: float) -> float | None:
        """The regression's pass time; None while its fit is rejected."""
        return self.decode_fit.predict(requests, kv_tokens)

    def prefill_time_s(self, tokens: float) -> float:
        """`tokens` prefilled in batch-budget chunks, one pass each (Dynamo's `estimate_next_ttft`)."""
        budget = self.prefill.max_num_batched_tokens
        total, remaining = 0.0, tokens
        while remaining > 0:
            chunk = min(remaining, budget)
            total += self.prefill_pass_s(chunk)
            remaining -= chunk
        return total

    def prefill_engine_rps(self, isl: float) -> float:
        """Requests per second one prefill engine serves at `isl`: 1 / wall_time(isl)."""
        return 1.0 / self.prefill_time_s(max(isl, 1.0))

    def decode_engine_rps(self, itl_s: float, context: float, osl: float) -> float | None:
        """Requests per second one decode engine serves within `itl_s`: the largest batch (KV cache and
        max_num_seqs bound it) whose step fits the ITL, over `osl` steps per request (Little's law); None while
        the regression is not ready."""
        d = self.decode
        cap = max(1, min(int(d.kv_cache_tokens / max(context, 1.0)), d.max_num_seqs))
        first = self.decode_pass_s(1, context)
        if first is None:
            return None
        best, best_step = 1, first
        if best_step <= itl_s:
            lo, hi = 1, cap
            while lo <= hi:
                mid = (lo + hi) // 2
                step = self.decode_pass_s(mid, mid * context) or math.inf
                if step <= itl_s:
                    best, best_step = mid, step
                    lo = mid + 1
                else:
                    hi = mid - 1
        return best / (max(osl, 1.0) * best_step)


class DecodeRegression:
    """Dynamo's `DecodeRegressionModel`: a decode pass's wall time = a + b x requests + c x KV tokens, fitted by
    least squares on at most 64 passes, kept evenly over a 4 x 4 grid of (requests, KV) (a new pass that makes
    one cell the fullest retires that cell's oldest). A fit with c < 0 is rejected (the model is not ready);
    b < 0 is clipped to 0. Bootstrapped from the profile as Dynamo is from its pre-deployment sweep, then taught
    by the engines' own passes, whose wall time includes what the profile's pure decode pass leaves out (joining
    requests' one-token prefill, short prompts prefilled on decode)."""

    def __init__(self, max_samples: int = MOVING_AVERAGE_SAMPLES, per_axis: int = 4) -> None:
        self.max_samples = max_samples
        self.per_axis = per_axis
        self._cells: dict[tuple[int, int], deque[tuple[float, float, float]]] = {}
        self._low = [math.inf, math.inf]
        self._high = [-math.inf, -math.inf]
        self.count = 0
        self._coef: tuple[float, float, float] | None = None
        self._stale = True

    def _cell(self, x: tuple[float, float]) -> tuple[int, int]:
        key: list[int] = []
        for axis, value in enumerate(x):
            low, high = self._low[axis], self._high[axis]
            index = 0 if high <= low else int((value - low) / (high - low) * self.per_axis)
            key.append(max(0, min(index, self.per_axis - 1)))
        return key[0], key[1]

    def add(self, requests: float, kv_tokens: float, wall_s: float) -> None:
        if wall_s <= 0:
            return
        x = (requests, kv_tokens)
        moved = False
        for axis, value in enumerate(x):
            if value < self._low[axis]:
                self._low[axis], moved = value, True
            if value > self._high[axis]:
                self._high[axis], moved = value, True
        if moved and self.count:
            everything = [sample for cell in self._cells.values() for sample in cell]
            self._cells = {}
            for sample in everything:
                self._cells.setdefault(self._cell((sample[0], sample[1])), deque()).append(sample)
        self._cells.setdefault(self._cell(x), deque()).append((requests, kv_tokens, wall_s))
        self.count += 1
        if self.count > self.max_samples:
            fullest = max(self._cells, key=lambda k: len(self._cells[k]))
            self._cells[fullest].popleft()
            if not self._cells[fullest]:
                del self._cells[fullest]
            self.count -= 1
        self._stale = True

    def predict(self, requests: float, kv_tokens: float) -> float | None:
        """A pass's wall time; None while the fit is rejected."""
        if self._stale:
            self._coef = self._fit()
            self._stale = False
        if self._coef is None:
            return None
        a, b, c = self._coef
        return max(1e-6, a + b * requests + c * kv_tokens)

    def _fit(self) -> tuple[float, float, float] | None:
        samples = [sample for cell in self._cells.values() for sample in cell]
        if len(samples) < 5:
            return None
        rows = [(1.0, r, k) for r, k, _ in samples]
        ata = [[sum(row[i] * row[j] for row in rows) for j in range(3)] for i in range(3)]
        atb = [sum(row[i] * w for row, (_, _, w) in zip(rows, samples, strict=True)) for i in range(3)]
        coef = _solve(ata, atb)
        if coef is None or coef[2] < 0:
            return None
        return coef[0], max(coef[1], 0.0), coef[2]


# ----------------------------------------------------------------------------------------------- the planner


class DynamoPlannerScaler:
    """Dynamo's SLA planner with both paths enabled (module docstring: sources and simplifications)."""

    def __init__(
        self,
        policy: PolicyConfig,
        prefill: EngineProfile,
        decode: EngineProfile,
        ttft_s: float,
        itl_s: float,
        *,
        throughput_interval_s: float = THROUGHPUT_INTERVAL_S,
        sensitivity: float = SCALE_DOWN_SENSITIVITY,
    ) -> None:
        self.name = "dynamo-planner"
        self.policy = policy
        self.model = PerfModel(prefill, decode)
        self.ttft_s = ttft_s
        self.itl_s = itl_s
        self.throughput_interval_s = throughput_interval_s
        self.sensitivity = sensitivity
        self.predictors = {"requests": ArimaPredictor(), "isl": ArimaPredictor(), "osl": ArimaPredictor()}
        #: The throughput path's floors; Dynamo starts them at 1.
        self.lower_bound: dict[Role, int] = {"prefill": 1, "decode": 1}
        self._next_throughput_s = throughput_interval_s
        self._last_frontend = FrontendTotals()
        self._last_throughput_at = 0.0
        self.avg_isl = _MovingAverage()
        self.avg_decode_len = _MovingAverage()

    def tick(self, observation: Observation) -> tuple[int, int]:
        signals = observation.signals
        wanted = self.load_path(observation)
        if observation.at >= self._next_throughput_s - 1e-9:
            self.throughput_path(observation.at, observation.frontend)
            self._next_throughput_s = observation.at + self.throughput_interval_s
        if wanted is None:
            wanted = (signals.prefill.desired, signals.decode.desired)
        return self.policy.prefill.clamp(wanted[0]), self.policy.decode.clamp(wanted[1])

    # -------------------------------------------------------------------------------------- load path

    def load_path(self, observation: Observation) -> tuple[int, int] | None:
        """The reactive path (`_advance_load_disagg`): None when nothing changes."""
        signals = observation.signals
        prefill_pool, decode_pool = signals.prefill, signals.decode
        prefill_engines, decode_engines = observation.engines["prefill"], observation.engines["decode"]
        # The moving averages learn from every tick's forward passes, whatever the decision.
        if prefill_pool.request_rate and prefill_pool.prompt_tokens_rate:
            self.avg_isl.add(prefill_pool.prompt_tokens_rate / prefill_pool.request_rate)
        for engine in decode_engines:
            if engine.scheduled_requests:
                self.avg_decode_len.add(engine.scheduled_kv_tokens / engine.scheduled_requests)
            if engine.last_pass is not None and engine.last_pass[0] > 0:
                self.model.decode_fit.add(*engine.last_pass)
        if not prefill_engines and not decode_engines:
            return None
        if prefill_pool.in_progress or decode_pool.in_progress:
            return None  # scaling in progress: observe only
        n_p, n_d = prefill_pool.ready, decode_pool.ready
        p = self.prefill_decision(prefill_engines, n_p) if prefill_engines else None
        d = self.decode_decision(decode_engines, n_d) if decode_engines else None
        final_p = max(n_p if p is None else p, self.lower_bound["prefill"], self.policy.prefill.min_replicas)
        final_d = max(n_d if d is None else d, self.lower_bound["decode"], self.policy.decode.min_replicas)
        final_p, final_d = self.policy.prefill.clamp(final_p), self.policy.decode.clamp(final_d)
        if (final_p, final_d) == (n_p, n_d):
            return None
        return final_p, final_d

    def prefill_ttft_s(self, queued_tokens: float) -> float:
        """An engine's estimated TTFT for the next request: its queue plus one average prompt."""
        return self.model.prefill_time_s(queued_tokens + self.avg_isl.value)

    def decode_itl_s(self, requests: float, kv_tokens: float) -> float | None:
        """An engine's estimated ITL with one average request added to its scheduled and queued work."""
        extra = self.avg_decode_len.value
        return self.model.decode_pass_s(requests + (1 if extra > 0 else 0), kv_tokens + extra)

    def prefill_decision(self, engines: Sequence[EngineSample], workers: int) -> int | None:
        """+1 when every engine's TTFT estimate is over the SLA; -1 when the consolidation check passes."""
        if workers == 0:
            return None
        consolidation = workers / (workers - 1) if workers > 1 else 1.0
        own = self.prefill_ttft_s(0)
        # The request's own compute does not shrink with more workers: only the queue's share gets the margin.
        budget = (self.ttft_s - own) * self.sensitivity
        can_shrink = workers > 1 and budget > 0
        estimates: list[float] = []
        for engine in engines:
            estimates.append(self.prefill_ttft_s(engine.queued_prefill_tokens))
            if can_shrink:
                post = self.prefill_ttft_s(int(engine.queued_prefill_tokens * consolidation))
                can_shrink = post - own < budget
        return self._scale(estimates, self.ttft_s, workers, can_shrink, "prefill")

    def decode_decision(self, engines: Sequence[EngineSample], workers: int) -> int | None:
        """+1 when every engine's ITL estimate is over the SLA; -1 when, with the load of `workers` engines on
        one fewer, every engine's KV still fits its cache and its ITL stays under SLA x sensitivity."""
        if workers == 0:
            return None
        consolidation = workers / (workers - 1) if workers > 1 else 1.0
        capacity = self.model.decode.kv_cache_tokens
        can_shrink = workers > 1
        estimates: list[float] = []
        for engine in engines:
            requests = engine.scheduled_requests + engine.queued_requests
            kv = engine.scheduled_kv_tokens + engine.queued_kv_tokens
            estimate = self.decode_itl_s(requests, kv)
            if estimate is not None:
                estimates.append(estimate)
            if can_shrink:
                post_kv = int(kv * consolidation)
                post_itl = self.decode_itl_s(math.ceil(requests * consolidation), post_kv)
                can_shrink = post_kv < capacity and post_itl is not None and post_itl < self.itl_s * self.sensitivity
        return self._scale(estimates, self.itl_s, workers, can_shrink, "decode")

    def _scale(self, estimates: list[float], sla: float, workers: int, can_shrink: bool, role: Role) -> int | None:
        """Dynamo's `_scale_decision`: up only when ALL engines are over the SLA."""
        if not estimates:
            return None
        if all(t > sla for t in estimates):
            return workers + 1
        if workers > 1 and can_shrink:
            return max(workers - 1, self.policy.bounds(role).min_replicas)
        return None

    # -------------------------------------------------------------------------------- throughput path

    def throughput_path(self, at: float, frontend: FrontendTotals) -> None:
        """The predictive path: observe the interval, predict the next, set the pools' lower bounds."""
        last = self._last_frontend
        requests = frontend.requests - last.requests
        duration = at - self._last_throughput_at
        self._last_frontend, self._last_throughput_at = frontend, at
        isl = (frontend.prompt_tokens - last.prompt_tokens) / requests if requests else 0.0
        osl = (frontend.output_tokens - last.output_tokens) / requests if requests else 0.0
        for key, value in (("requests", float(requests)), ("isl", isl), ("osl", osl)):
            self.predictors[key].add(value)
        if duration <= 0:
            return
        demand_rps = self.predictors["requests"].predict() / duration
        next_isl, next_osl = self.predictors["isl"].predict(), self.predictors["osl"].predict()
        prefill, decode = self.replicas_for(demand_rps, next_isl, next_osl)
        self.lower_bound = {"prefill": prefill, "decode": decode}

    def replicas_for(self, demand_rps: float, isl: float, osl: float) -> tuple[int, int]:
        """(prefill, decode) replicas for a predicted demand, from the engines' rates at the SLAs."""
        if isl <= 0 or osl <= 0:
            return self.lower_bound["prefill"], self.lower_bound["decode"]
        one_prefill = self.model.prefill_time_s(isl)
        # A single prompt that alone misses the TTFT SLA asks for a latency floor of replicas.
        sla_floor = math.ceil(one_prefill / self.ttft_s) if one_prefill > self.ttft_s else 1
        prefill = max(math.ceil(demand_rps / self.model.prefill_engine_rps(isl)), sla_floor)
        decode_rps = self.model.decode_engine_rps(self.itl_s, isl + osl / 2, osl)
        if decode_rps is None:
            # The decode model is not ready: Dynamo skips the whole disagg throughput decision.
            return self.lower_bound["prefill"], self.lower_bound["decode"]
        decode = math.ceil(demand_rps / decode_rps)
        return (
            max(prefill, self.policy.prefill.min_replicas),
            max(decode, self.policy.decode.min_replicas),
        )
