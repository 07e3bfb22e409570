// Precision telemetry (the spec's "Future work" 3): every gate result as one JSON line in
// $XDG_STATE_HOME/ptllm/telemetry.jsonl (default ~/.local/state/ptllm/), and, only when the
// user names one (--telemetry-url URL or $PTLLM_TELEMETRY_URL), a sink that POSTs each record
// (Content-Type application/json) from a background thread. Plain http:// only. The sink never
// blocks or fails the run: records queue (bounded, the excess is dropped), each request has
// short timeouts, a failure is logged once on stderr, and shutdown waits at most ~2 s.
#pragma once

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>

#include "gate/capabilities.h"
#include "gate/gate.h"

namespace ptllm {

// $XDG_STATE_HOME/ptllm/telemetry.jsonl, else $HOME/.local/state/ptllm/telemetry.jsonl.
std::string telemetryFile();

// The record of one gate result: toJson(r) plus "event":"gate", "time" (UTC ISO 8601),
// "backend", "cpu_model", "dispatched_target", "flags" (the usable ones), "build_id".
nlohmann::json telemetryRecord(const GateResult& r, const Capabilities& caps,
                               const std::string& backend);

// Appends the record to telemetryFile() (one line, O_APPEND) and hands it to the sink when one
// is set. Never throws; a file error is logged once on stderr.
void recordTelemetry(const nlohmann::json& record);

// Sets (or, with "", removes) the POST sink. Process-wide, thread-safe. A URL that is not
// http://host[:port][/path] is rejected with one stderr line and no sink.
void setTelemetryUrl(const std::string& url);
// Waits up to `timeout` for the sink to send (or give up on) every queued record; true if the
// queue drained. For tests and for a clean exit.
bool flushTelemetry(std::chrono::milliseconds timeout);

}  // namespace ptllm
