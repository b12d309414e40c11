#pragma once
// A strict JSON parser for tests (RFC 8259: no trailing commas, no comments, no NaN, escapes
// checked, one value then only whitespace), so a test can check that what seqpar writes is
// JSON and read it back. Small and slow on purpose; for documents of a few megabytes at most.

#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace seqpar::test::json {

/// A parsed JSON value.
struct Value {
  enum class Type { null, boolean, number, string, array, object };
  Type type = Type::null;
  bool b = false;
  double n = 0;
  std::string s;
  std::vector<Value> a;
  std::map<std::string, Value> o;

  bool is(Type t) const { return type == t; }
  /// The member `key` of an object, or nullptr (also when this is not an object).
  const Value* get(const std::string& key) const {
    if (type != Type::object) return nullptr;
    const auto it = o.find(key);
    return it == o.end() ? nullptr : &it->second;
  }
};

/// Thrown on malformed input; what() names the offset.
struct ParseError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

namespace detail {

class Parser {
 public:
  explicit Parser(std::string_view text) : t_(text) {}

  Value document() {
    Value v = value(0);
    space();
    if (i_ != t_.size()) fail("text after the value");
    return v;
  }

 private:
  [[noreturn]] void fail(const char* what) const {
    throw ParseError(std::string("json: ") + what + " at offset " + std::to_string(i_));
  }
  void space() {
    while (i_ < t_.size() && (t_[i_] == ' ' || t_[i_] == '\t' || t_[i_] == '\n' || t_[i_] == '\r')) ++i_;
  }
  char peek() const { return i_ < t_.size() ? t_[i_] : '\0'; }
  void expect(char c) {
    if (peek() != c) fail("unexpected character");
    ++i_;
  }
  void word(std::string_view w) {
    if (t_.substr(i_, w.size()) != w) fail("bad literal");
    i_ += w.size();
  }

  Value value(int depth) {
    if (depth > 64) fail("nested too deep");
    space();
    Value v;
    switch (peek()) {
      case '{': {
        v.type = Value::Type::object;
        ++i_;
        space();
        if (peek() == '}') {
          ++i_;
          return v;
        }
        for (;;) {
          space();
          if (peek() != '"') fail("object key must be a string");
          std::string key = string();
          space();
          expect(':');
          if (!v.o.emplace(key, value(depth + 1)).second) fail("duplicate key");
          space();
          if (peek() == ',') {
            ++i_;
            continue;
          }
          expect('}');
          return v;
        }
      }
      case '[': {
        v.type = Value::Type::array;
        ++i_;
        space();
        if (peek() == ']') {
          ++i_;
          return v;
        }
        for (;;) {
          v.a.push_back(value(depth + 1));
          space();
          if (peek() == ',') {
            ++i_;
            continue;
          }
          expect(']');
          return v;
        }
      }
      case '"':
        v.type = Value::Type::string;
        v.s = string();
        return v;
      case 't':
        word("true");
        v.type = Value::Type::boolean;
        v.b = true;
        return v;
      case 'f':
        word("false");
        v.type = Value::Type::boolean;
        return v;
      case 'n':
        word("null");
        return v;
      default:
        v.type = Value::Type::number;
        v.n = number();
        return v;
    }
  }

  std::string string() {
    expect('"');
    std::string out;
    for (;;) {
      if (i_ >= t_.size()) fail("unterminated string");
      const char c = t_[i_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
      if (c != '\\') {
        out += c;
        continue;
      }
      const char e = peek();
      ++i_;
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          unsigned code = 0;
          for (int k = 0; k < 4; ++k) {
            const char h = peek();
            if (!std::isxdigit(static_cast<unsigned char>(h))) fail("bad \\u escape");
            code = code * 16 + static_cast<unsigned>(std::isdigit(static_cast<unsigned char>(h)) ? h - '0'
                                                                                              : (h | 0x20) - 'a' + 10);
            ++i_;
          }
          if (code < 0x80) out += static_cast<char>(code);
          else out += '?';  // enough for tests: seqpar writes ASCII
          break;
        }
        default: fail("bad escape");
      }
    }
  }

  double number() {
    const std::size_t start = i_;
    if (peek() == '-') ++i_;
    if (peek() == '0') {
      ++i_;
    } else if (std::isdigit(static_cast<unsigned char>(peek()))) {
      while (std::isdigit(static_cast<unsigned char>(peek()))) ++i_;
    } else {
      fail("expected a value");
    }
    if (peek() == '.') {
      ++i_;
      if (!std::isdigit(static_cast<unsigned char>(peek()))) fail("digit expected after '.'");
      while (std::isdigit(static_cast<unsigned char>(peek()))) ++i_;
    }
    if (peek() == 'e' || peek() == 'E') {
      ++i_;
      if (peek() == '+' || peek() == '-') ++i_;
      if (!std::isdigit(static_cast<unsigned char>(peek()))) fail("digit expected in exponent");
      while (std::isdigit(static_cast<unsigned char>(peek()))) ++i_;
    }
    const std::string text(t_.substr(start, i_ - start));
    const double d = std::strtod(text.c_str(), nullptr);
    if (!std::isfinite(d)) fail("number out of range");
    return d;
  }

  std::string_view t_;
  std::size_t i_ = 0;
};

}  // namespace detail

/// Parses `text` as one JSON document; throws ParseError if it is not one.
inline Value parse(std::string_view text) { return detail::Parser(text).document(); }

}  // namespace seqpar::test::json
