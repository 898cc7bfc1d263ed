// A recording as a self-contained HTML page: the bytes of each category stacked over time
// (or the order of events), the phase of each event as a band under them, each event's block
// on hover, the peak's parts in the legend, the peak and any refused allocation marked.
#include "timeline.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <nlohmann/json.hpp>
#include <string>

#include "frugal/memory/format.h"
#include "recorder_impl.h"

namespace frugal::detail {
namespace {

constexpr std::size_t kMostPoints = 4000;  // a page a browser draws at once

std::size_t index_of(MemoryCategory c) { return static_cast<std::size_t>(c); }

}  // namespace

std::vector<TimelinePoint> timeline_points(const Recording& r) {
  // The bytes of each category before the first event kept: the blocks alive at the end
  // with every kept event undone, and the bytes alive before the recording unidentified.
  // The first kNamed names are counted apart too, as part of `Other`.
  std::array<std::int64_t, kCategories> totals{};
  std::array<std::int64_t, kNamed> named{};
  auto add_named = [&named](std::int32_t label, std::int64_t bytes) {
    if (label >= 0 && static_cast<std::size_t>(label) < kNamed) {
      named[static_cast<std::size_t>(label)] += bytes;
    }
  };
  for (const auto& [address, block] : r.live) {
    totals[index_of(block.category)] += block.bytes;
    add_named(block.label, block.bytes);
  }
  totals[index_of(MemoryCategory::Other)] += r.unattributed;
  for (auto it = r.events.rbegin(); it != r.events.rend(); ++it) {
    if (it->action == EventAction::Alloc) {
      totals[index_of(it->category)] -= it->bytes;
      add_named(it->label, -it->bytes);
    } else if (it->action == EventAction::Free) {
      totals[index_of(it->known ? it->category : MemoryCategory::Other)] += it->bytes;
      add_named(it->label, it->bytes);
    }
  }
  std::vector<TimelinePoint> points;
  points.reserve(r.events.size());
  for (std::size_t i = 0; i < r.events.size(); ++i) {
    const auto& e = r.events[i];
    if (e.action == EventAction::Alloc) {
      totals[index_of(e.category)] += e.bytes;
      add_named(e.label, e.bytes);
    } else if (e.action == EventAction::Free) {
      totals[index_of(e.known ? e.category : MemoryCategory::Other)] -= e.bytes;
      add_named(e.label, -e.bytes);
    }
    points.push_back({i, totals, named});
  }
  return points;
}

std::vector<TimelinePoint> thin(const std::vector<TimelinePoint>& points, std::size_t most) {
  // Each run of points keeps its highest total: the peak always survives.
  if (points.size() <= most) {
    return points;
  }
  std::vector<TimelinePoint> kept;
  const double run = static_cast<double>(points.size()) / static_cast<double>(most);
  std::size_t begin = 0;
  for (std::size_t k = 0; k < most && begin < points.size(); ++k) {
    const auto end =
        std::min(points.size(), static_cast<std::size_t>(static_cast<double>(k + 1) * run));
    std::size_t best = begin;
    for (std::size_t i = begin; i < end; ++i) {
      if (points[i].total() > points[best].total()) {
        best = i;
      }
    }
    kept.push_back(points[best]);
    begin = std::max(end, begin + 1);
  }
  return kept;
}

void write_timeline_html(const Recording& r, std::ostream& out) {
  const auto points = thin(timeline_points(r), kMostPoints);
  // The page's parts: the categories, then the first names, each out of `Other`.
  auto categories = nlohmann::json::array();
  for (std::size_t c = 0; c < kCategories; ++c) {
    categories.push_back(to_string(static_cast<MemoryCategory>(c)));
  }
  const auto names = std::min(kNamed, r.labels.size());
  for (std::size_t n = 0; n < names; ++n) {
    categories.push_back(r.labels[n]);
  }
  auto rows = nlohmann::json::array();
  for (const auto& p : points) {
    const auto& e = r.events[p.event];
    std::vector<std::int64_t> parts(p.bytes.begin(), p.bytes.end());
    for (std::size_t n = 0; n < names; ++n) {
      parts[index_of(MemoryCategory::Other)] -= p.named[n];
      parts.push_back(p.named[n]);
    }
    const char* action = e.action == EventAction::Alloc  ? "alloc"
                         : e.action == EventAction::Free ? "free"
                                                         : "refused";
    rows.push_back({e.seq, e.time_us, parts, action, e.bytes,
                    e.label >= 0 ? r.labels[static_cast<std::size_t>(e.label)]
                                 : std::string(to_string(e.category)),
                    e.unit < 0 ? "" : r.units[static_cast<std::size_t>(e.unit)], to_string(e.phase),
                    to_string(e.at)});
  }
  auto refused = nlohmann::json::array();
  for (std::size_t i = 0; i < points.size(); ++i) {
    if (r.events[points[i].event].action == EventAction::Refused) {
      refused.push_back(i);
    }
  }
  const nlohmann::json data = {
      {"categories", categories},
      {"points", rows},
      {"refused", refused},
      {"peak", r.peak.bytes},
      {"summary", r.peak.event >= 0 || !r.events.empty() ? r.peak.summary()
                                                         : std::string("nothing was recorded")},
      {"events", r.events.size()},
      {"dropped", r.dropped}};
  // "</" cannot end the script early: JSON allows "<\/".
  std::string json = data.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  for (std::size_t at = json.find("</"); at != std::string::npos; at = json.find("</", at + 3)) {
    json.replace(at, 2, "<\\/");
  }
  out << timeline_page_head() << "<script>const DATA = " << json << ";\n"
      << timeline_page_script() << "</script>\n</body>\n</html>\n";
}

}  // namespace frugal::detail
