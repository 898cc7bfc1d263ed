// A recording as PyTorch's memory snapshot: the dictionary torch.cuda.memory._snapshot()
// returns (segments, device_traces), pickled as Python's pickle module writes protocol 2.
#include <fmt/format.h>

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "file_write.h"
#include "frugal/error.h"
#include "frugal/memory/format.h"
#include "recorder_impl.h"

namespace frugal::detail {
namespace {

// `s` with each byte that starts no valid UTF-8 sequence replaced by U+FFFD (a module's
// name may be any bytes; the viewers read UTF-8).
std::string valid_utf8(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  const auto* b = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  for (std::size_t i = 0; i < n;) {
    const unsigned c = b[i];
    const std::size_t len = c < 0x80         ? 1
                            : (c >> 5) == 6  ? 2
                            : (c >> 4) == 14 ? 3
                            : (c >> 3) == 30 ? 4
                                             : 0;
    bool ok = len > 0 && i + len <= n;
    for (std::size_t k = 1; ok && k < len; ++k) {
      ok = (b[i + k] & 0xC0) == 0x80;
    }
    if (ok && len > 1) {  // no overlong forms, surrogates or code points past U+10FFFF
      const unsigned second = b[i + 1];
      ok = !(len == 2 && c < 0xC2) && !(len == 3 && c == 0xE0 && second < 0xA0) &&
           !(len == 3 && c == 0xED && second >= 0xA0) &&
           !(len == 4 && c == 0xF0 && second < 0x90) &&
           !(len == 4 && (c > 0xF4 || (c == 0xF4 && second >= 0x90)));
    }
    if (ok) {
      out.append(s, i, len);
      i += len;
    } else {
      out += "\xEF\xBF\xBD";
      ++i;
    }
  }
  return out;
}

// Python's pickle opcodes (protocol 2) for the values a snapshot holds.
class Pickler {
 public:
  explicit Pickler(std::ostream& out) : out_(out) {}

  void write(const nlohmann::json& value) {
    out_.put('\x80').put('\x02');  // PROTO 2
    put(value);
    out_.put('.');  // STOP
  }

 private:
  void put(const nlohmann::json& v) {
    switch (v.type()) {
      case nlohmann::json::value_t::null:
        out_.put('N');
        break;
      case nlohmann::json::value_t::boolean:
        out_.put(v.get<bool>() ? '\x88' : '\x89');
        break;
      case nlohmann::json::value_t::number_integer:
      case nlohmann::json::value_t::number_unsigned:
        put_int(v.is_number_unsigned() ? static_cast<std::int64_t>(v.get<std::uint64_t>())
                                       : v.get<std::int64_t>());
        break;
      case nlohmann::json::value_t::number_float:
        put_float(v.get<double>());
        break;
      case nlohmann::json::value_t::string:
        put_string(v.get_ref<const std::string&>());
        break;
      case nlohmann::json::value_t::array:
        out_.put(']');  // EMPTY_LIST
        put_items(
            v, [&](const auto& item) { put(item); }, 'e');
        break;
      case nlohmann::json::value_t::object:
        out_.put('}');  // EMPTY_DICT
        put_items(
            v.items(),
            [&](const auto& item) {
              put_string(item.key());
              put(item.value());
            },
            'u');
        break;
      default:
        put_string(v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    }
  }

  // MARK, the items, then APPENDS or SETITEMS, a thousand at a time as Python does.
  template <typename Range, typename Fn>
  void put_items(const Range& range, Fn fn, char close) {
    std::size_t n = 0;
    for (const auto& item : range) {
      if (n % 1000 == 0) {
        if (n > 0) {
          out_.put(close);
        }
        out_.put('(');
      }
      fn(item);
      ++n;
    }
    if (n > 0) {
      out_.put(close);
    }
  }

  void put_int(std::int64_t i) {
    if (i >= INT32_MIN && i <= INT32_MAX) {
      out_.put('J');  // BININT: 4 bytes, little-endian
      put_le(static_cast<std::uint64_t>(static_cast<std::int64_t>(i)), 4);
    } else {
      out_.put('\x8a').put('\x08');  // LONG1 of 8 bytes, two's complement little-endian
      put_le(static_cast<std::uint64_t>(i), 8);
    }
  }

  void put_float(double d) {
    out_.put('G');  // BINFLOAT: 8 bytes, big-endian
    std::uint64_t bits = 0;
    std::memcpy(&bits, &d, sizeof bits);
    for (int shift = 56; shift >= 0; shift -= 8) {
      out_.put(static_cast<char>((bits >> shift) & 0xff));
    }
  }

  void put_string(const std::string& text) {
    const auto s = valid_utf8(text);  // Python refuses a BINUNICODE that is not UTF-8
    out_.put('X');                    // BINUNICODE: 4-byte length, UTF-8
    put_le(s.size(), 4);
    out_.write(s.data(), static_cast<std::streamsize>(s.size()));
  }

  void put_le(std::uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) {
      out_.put(static_cast<char>((v >> (8 * i)) & 0xff));
    }
  }

  std::ostream& out_;
};

// The viewer shows an allocation's frames as its stack: here the category, the unit and the
// phase, innermost first.
nlohmann::json frames(const Recording& r, MemoryCategory category, std::int32_t unit,
                      MemoryPhase phase) {
  auto frame = [](const std::string& name) {
    return nlohmann::json{{"filename", "frugal"}, {"line", 0}, {"name", name}};
  };
  auto list = nlohmann::json::array();
  list.push_back(frame(to_string(category)));
  if (unit >= 0) {
    list.push_back(frame(r.units[static_cast<std::size_t>(unit)]));
  }
  list.push_back(frame(to_string(phase)));
  return list;
}

nlohmann::json segment(int device, std::uintptr_t address, std::int64_t bytes,
                       nlohmann::json block_frames) {
  // One segment a block: the counting allocator takes each block from the system alone (a
  // CUDA recording draws its blocks so too: the trace says nothing of segments' other blocks).
  // Sizes are requested bytes, as the trace's, so the viewer's totals are allocated bytes.
  nlohmann::json block = {{"address", address},
                          {"size", bytes},
                          {"requested_size", bytes},
                          {"state", "active_allocated"},
                          {"frames", std::move(block_frames)}};
  return {{"device", device},
          {"address", address},
          {"total_size", bytes},
          {"allocated_size", bytes},
          {"active_size", bytes},
          {"requested_size", bytes},
          {"stream", 0},
          {"segment_type", "large"},
          {"segment_pool_id", nlohmann::json::array({0, 0})},
          {"is_expandable", false},
          {"frames", nlohmann::json::array()},
          {"blocks", nlohmann::json::array({std::move(block)})}};
}

std::string extension(const std::string& path) {
  const auto dot = path.rfind('.');
  const auto slash = path.rfind('/');
  return dot == std::string::npos || (slash != std::string::npos && dot < slash) ? std::string()
                                                                                 : path.substr(dot);
}

void check_kind(const std::string& kind, const std::string& path) {
  FRUGAL_CHECK(
      kind == ".pickle" || kind == ".pkl" || kind == ".html" || kind == ".png" || kind == ".json",
      "frugal: a memory recording is written as .pickle, .pkl, .html, .png or .json, not '", path,
      "'");
}

}  // namespace

void write_snapshot(const Recording& r, std::ostream& out) {
  const int device = std::max(0, r.device);  // the CPU's trace is drawn as device 0's
  auto segments = nlohmann::json::array();
  for (const auto& [address, block] : r.live) {
    segments.push_back(
        segment(device, address, block.bytes, frames(r, block.category, block.unit, block.phase)));
  }
  if (r.unattributed > 0) {
    // The bytes alive before the recording that no watched tensor holds, as one block at
    // an address no block has (0): the viewer's totals stay the allocated bytes.
    auto unknown = frames(r, MemoryCategory::Other, -1, MemoryPhase::Other);
    unknown.front()["name"] = "alive before the recording";
    segments.push_back(segment(device, 0, r.unattributed, std::move(unknown)));
  }
  auto trace = nlohmann::json::array();
  for (const auto& e : r.events) {
    nlohmann::json entry = {{"addr", e.address},
                            {"size", e.bytes},
                            {"stream", 0},
                            {"time_us", e.time_us},
                            {"frames", frames(r, e.category, e.unit, e.phase)}};
    if (e.action == EventAction::Alloc) {
      entry["action"] = "alloc";
      trace.push_back(std::move(entry));
    } else if (e.action == EventAction::Free) {
      entry["action"] = "free_requested";  // CUDA's two steps; on the CPU at once
      trace.push_back(entry);
      entry["action"] = "free_completed";
      trace.push_back(std::move(entry));
    } else {
      entry["action"] = "oom";
      entry["device_free"] = std::max<std::int64_t>(0, e.cap - e.allocated);
      trace.push_back(std::move(entry));
    }
  }
  auto traces = nlohmann::json::array();  // one list a device, up to the one recorded
  for (int d = 0; d < device; ++d) {
    traces.push_back(nlohmann::json::array());
  }
  traces.push_back(std::move(trace));
  const nlohmann::json snapshot = {
      {"segments", std::move(segments)},
      {"device_traces", std::move(traces)},
      {"allocator_settings",
       nlohmann::json::object(
           {{"allocator", r.device < 0 ? std::string("frugal CountingAllocator (CPU)")
                                       : fmt::format("CUDA caching allocator, device {}, its trace",
                                                     r.device)}})},
      {"frugal",
       {{"start_bytes", r.start_bytes},
        {"end_bytes", r.end_bytes},
        {"peak_bytes", r.peak.bytes},
        {"dropped_events", r.dropped}}}};
  Pickler(out).write(snapshot);
}

void write_events_json(const Recording& r, std::ostream& out) {
  auto events = nlohmann::json::array();
  for (const auto& e : r.events) {
    const char* action = e.action == EventAction::Alloc  ? "alloc"
                         : e.action == EventAction::Free ? "free"
                                                         : "refused";
    events.push_back({{"seq", e.seq},
                      {"time_us", e.time_us},
                      {"action", action},
                      {"address", e.address},
                      {"bytes", e.bytes},
                      {"allocated", e.allocated},
                      {"category", to_string(e.known ? e.category : MemoryCategory::Other)},
                      {"unit", e.unit < 0 ? "" : r.units[static_cast<std::size_t>(e.unit)]},
                      {"phase", to_string(e.phase)},
                      {"at", to_string(e.at)}});
  }
  auto groups = nlohmann::json::array();
  for (const auto& g : r.peak.groups) {
    groups.push_back({{"category", to_string(g.category)},
                      {"module", g.module},
                      {"bytes", g.bytes},
                      {"blocks", g.blocks}});
  }
  out << nlohmann::json{{"start_bytes", r.start_bytes},
                        {"end_bytes", r.end_bytes},
                        {"dropped", r.dropped},
                        {"peak",
                         {{"bytes", r.peak.bytes},
                          {"event", r.peak.event},
                          {"phase", to_string(r.peak.phase)},
                          {"groups", groups}}},
                        {"events", events}}
             .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
      << "\n";
}

void check_recording_kind(const std::string& path) { check_kind(extension(path), path); }

void write_recording(const Recording& recording, std::ostream& out, const std::string& kind) {
  check_kind(kind, kind);
  if (kind == ".html") {
    write_timeline_html(recording, out);
  } else if (kind == ".png") {
    write_timeline_png(recording, out);
  } else if (kind == ".json") {
    write_events_json(recording, out);
  } else {
    write_snapshot(recording, out);
  }
}

void write_recording(const Recording& recording, const std::string& path) {
  check_recording_kind(path);
  std::ostringstream out;  // whole in memory first: a failed write leaves the old file
  write_recording(recording, out, extension(path));
  const auto bytes = out.str();
  write_whole(path, {{bytes.data(), bytes.size()}});
}

}  // namespace frugal::detail

namespace frugal {

void MemoryRecorder::check_path(const std::string& path) { detail::check_recording_kind(path); }

void MemoryRecorder::write(const std::string& path) const {
  detail::write_recording(impl_->recording(), path);
}

void MemoryRecorder::write_to(std::ostream& out, const std::string& kind) const {
  detail::write_recording(impl_->recording(), out, kind);
}

std::string MemoryPeak::summary(std::size_t top) const {
  std::string s = fmt::format("at the peak ({}, {}):", format_bytes(bytes), to_string(phase));
  std::int64_t rest = 0;
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const auto& g = groups[i];
    if (i >= top) {
      rest += g.bytes;
      continue;
    }
    const auto whose = g.module.empty()          ? std::string()
                       : g.module.front() == '(' ? " " + g.module
                                                 : " of " + g.module;
    s += fmt::format("{} {}{} {}", i == 0 ? "" : ",", to_string(g.category), whose,
                     format_bytes(g.bytes));
  }
  if (rest != 0) {
    s += fmt::format(", the rest {}", format_bytes(rest));
  }
  return s;
}

}  // namespace frugal
