// ferry's TorchScript shim: the few calls the server makes into libtorch's C++ API, behind a C
// ABI. ferry compiles it on the machine against the headers of the PyTorch it runs (PyTorch's C++
// API has no stable ABI), caches the library, and loads it at run time. Every C++ exception stays
// here: each call reports failure as a message the caller frees with fts_free_string.
#include <torch/script.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/jit/passes/inliner.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

// ferry's datatype codes are the model configuration's (TYPE_BOOL = 1 ... TYPE_BF16 = 14).
bool to_scalar(int32_t code, at::ScalarType* out) {
  switch (code) {
    case 1: *out = at::kBool; return true;
    case 2: *out = at::kByte; return true;
    case 3: *out = at::kUInt16; return true;
    case 4: *out = at::kUInt32; return true;
    case 5: *out = at::kUInt64; return true;
    case 6: *out = at::kChar; return true;
    case 7: *out = at::kShort; return true;
    case 8: *out = at::kInt; return true;
    case 9: *out = at::kLong; return true;
    case 10: *out = at::kHalf; return true;
    case 11: *out = at::kFloat; return true;
    case 12: *out = at::kDouble; return true;
    case 14: *out = at::kBFloat16; return true;
    default: return false;
  }
}

int32_t from_scalar(at::ScalarType t) {
  switch (t) {
    case at::kBool: return 1;
    case at::kByte: return 2;
    case at::kUInt16: return 3;
    case at::kUInt32: return 4;
    case at::kUInt64: return 5;
    case at::kChar: return 6;
    case at::kShort: return 7;
    case at::kInt: return 8;
    case at::kLong: return 9;
    case at::kHalf: return 10;
    case at::kFloat: return 11;
    case at::kDouble: return 12;
    case at::kBFloat16: return 14;
    default: return 0;
  }
}

char* copy_string(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out != nullptr) {
    std::memcpy(out, s.data(), s.size());
    out[s.size()] = '\0';
  }
  return out;
}

void fail(char** err, const std::string& what) {
  if (err != nullptr) *err = copy_string(what);
}

// Runs `body`, turning any exception into a message (c10's without its C++ backtrace).
template <typename F>
bool guarded(char** err, F&& body) {
  try {
    body();
    return true;
  } catch (const c10::Error& e) {
    fail(err, e.what_without_backtrace());
  } catch (const std::exception& e) {
    fail(err, e.what());
  } catch (...) {
    fail(err, "an unknown error");
  }
  return false;
}

struct Model {
  torch::jit::Module module;
};

// One output, held until the result is freed: a contiguous tensor, or strings.
struct Output {
  std::string key;
  at::Tensor tensor;
  std::vector<std::string> strings;
  std::vector<const char*> pointers;
  std::vector<int64_t> lengths;
  bool is_strings = false;
};

struct Result {
  std::vector<Output> outputs;
  bool keyed = false;
};

}  // namespace

extern "C" {

// An input or an output: a tensor (dtype, shape, data), or a list of strings (is_strings).
struct fts_tensor {
  int32_t dtype;
  int32_t ndim;
  const int64_t* shape;
  void* data;
  int64_t nbytes;
  int32_t is_strings;
  int64_t count;
  const char* const* strings;
  const int64_t* lengths;
};

void fts_free_string(char* s) { std::free(s); }

void* fts_load(const char* path, char** err) {
  std::unique_ptr<Model> model;
  bool ok = guarded(err, [&] {
    model = std::make_unique<Model>();
    model->module = torch::jit::load(path, c10::Device(c10::kCPU));
    model->module.eval();
  });
  return ok ? model.release() : nullptr;
}

// A copy of the module for another instance: its own attribute slots (a forward that assigns
// `self.x` never races another instance's), the same parameter and buffer tensors.
void* fts_share(void* model, char** err) {
  std::unique_ptr<Model> copy;
  bool ok = guarded(err, [&] {
    copy = std::make_unique<Model>();
    copy->module = static_cast<Model*>(model)->module.clone(/*inplace=*/true);
    copy->module.eval();
  });
  return ok ? copy.release() : nullptr;
}

// Whether an operator divides integers with a rounding mode or takes a remainder (or a gcd, which
// takes remainders): on integers, INT64_MIN divided by -1 (or by zero, for some) is a hardware fault
// that ends the process. Matched by part of the name, so every overload and in-place form counts.
// The unchecked indexing operators (`_unsafe_index`, `_unsafe_masked_index`...) count too.
static bool divides(const torch::jit::Node* node, const std::string& kind) {
  if (kind == "aten::div") return node->inputs().size() >= 3;
  static const char* const parts[] = {"aten::div_", "floor_divide", "floordiv", "remainder", "fmod",
                                      "divmod",     "mod__",        "aten::gcd", "aten::lcm", "_unsafe_index",
                                      "_unsafe_masked_index"};
  for (const char* part : parts) {
    if (kind.find(part) != std::string::npos) return true;
  }
  return false;
}

// The operators of forward (everything it calls inlined) that divide integers as above, and the
// nodes whose code the walk cannot see (forked or awaited subgraphs, calls left uninlined, such as
// calls through an interface), by name ("prim::..."). Empty when there are none; freed by the caller.
char* fts_faulting_ops(void* model, char** err) {
  std::string found;
  bool ok = guarded(err, [&] {
    auto& fn = static_cast<Model*>(model)->module.get_method("forward").function();
    auto graph = torch::jit::toGraphFunction(fn).graph()->copy();
    torch::jit::Inline(*graph);
    std::vector<torch::jit::Block*> blocks{graph->block()};
    while (!blocks.empty()) {
      auto* block = blocks.back();
      blocks.pop_back();
      for (auto* node : block->nodes()) {
        for (auto* b : node->blocks()) blocks.push_back(b);
        std::string kind = node->kind().toQualString();
        bool opaque = kind == "prim::fork" || kind == "prim::awaitable" || kind == "prim::CallMethod" ||
                      kind == "prim::CallFunction" || node->hasAttribute(torch::jit::attr::Subgraph);
        if (opaque && kind.rfind("prim::", 0) != 0) kind = "prim::Subgraph (" + kind + ")";
        if (opaque || divides(node, kind)) {
          if (found.find(kind) == std::string::npos) found += (found.empty() ? "" : ", ") + kind;
        }
      }
    }
  });
  return ok ? copy_string(found) : nullptr;
}

void fts_free(void* model) { delete static_cast<Model*>(model); }

// forward's arguments after self: the count (when index < 0), or one's name and whether it is
// required.
int32_t fts_argument(void* model, int32_t index, const char** name, int32_t* required) {
  int32_t count = -1;
  guarded(nullptr, [&] {
    const auto& args = static_cast<Model*>(model)->module.get_method("forward").function().getSchema().arguments();
    count = static_cast<int32_t>(args.size()) - 1;
    if (index >= 0 && index < count) {
      const auto& a = args[index + 1];
      *name = a.name().c_str();
      *required = a.default_value().has_value() ? 0 : 1;
    }
  });
  return count;
}

static c10::IValue to_ivalue(const fts_tensor& t) {
  if (t.is_strings) {
    c10::List<std::string> list;
    for (int64_t i = 0; i < t.count; i++) list.push_back(std::string(t.strings[i], static_cast<size_t>(t.lengths[i])));
    return list;
  }
  at::ScalarType type;
  if (!to_scalar(t.dtype, &type)) throw std::runtime_error("a datatype PyTorch has no tensors of");
  std::vector<int64_t> shape(t.shape, t.shape + t.ndim);
  // A tensor of its own, copied from the request: the model may write it in place, or keep it
  // past this call (in an attribute), and the request's bytes are not the model's to keep.
  auto tensor = at::empty(shape, at::TensorOptions().dtype(type));
  if (tensor.nbytes() != static_cast<size_t>(t.nbytes)) throw std::runtime_error("an input's size disagrees with its shape");
  if (t.nbytes > 0) std::memcpy(tensor.data_ptr(), t.data, static_cast<size_t>(t.nbytes));
  return tensor;
}

static bool is_strings(const c10::IValue& v) {
  return v.isList() && v.toList().elementType()->kind() == c10::TypeKind::StringType;
}

static void add_output(Result& result, const std::string& key, const c10::IValue& v) {
  Output out;
  out.key = key;
  if (v.isTensor()) {
    const auto& t = v.toTensor();
    // Only a plain tensor in memory has bytes to read (not a nested, sparse or opaque one).
    if (t.is_nested() || t.layout() != at::kStrided || !t.has_storage() || t.is_meta()) {
      throw std::runtime_error("output '" + key + "' is not a dense tensor in memory");
    }
    auto plain = t.detach();
    // An "efficient zero" tensor has no memory behind it; a negated or conjugated view holds the
    // values before the sign or conjugation is applied: each is made an ordinary tensor first.
    if (plain._is_zerotensor()) plain = at::zeros(plain.sizes(), at::TensorOptions().dtype(plain.scalar_type()));
    out.tensor = plain.to(at::kCPU).resolve_conj().resolve_neg().contiguous();
    if (out.tensor.nbytes() > 0 && out.tensor.data_ptr() == nullptr) {
      throw std::runtime_error("output '" + key + "' has no memory behind it");
    }
  } else if (is_strings(v)) {
    out.is_strings = true;
    for (const auto& s : v.toListRef()) out.strings.push_back(s.toStringRef());
  } else {
    throw std::runtime_error("output '" + key + "' is a " + v.tagKind() + ", not a tensor or a list of strings");
  }
  for (const auto& s : out.strings) {
    out.pointers.push_back(s.data());
    out.lengths.push_back(static_cast<int64_t>(s.size()));
  }
  result.outputs.push_back(std::move(out));
}

// Runs forward on positional then keyword inputs, with `threads` OpenMP threads on this thread,
// in inference mode (else without gradients).
void* fts_run(void* model, const fts_tensor* positional, int32_t n_positional, const fts_tensor* keywords,
              const char* const* names, int32_t n_keywords, int32_t inference_mode, int32_t threads, char** err) {
  std::unique_ptr<Result> result;
  bool ok = guarded(err, [&] {
    at::init_num_threads();
#ifdef _OPENMP
    if (threads > 0) omp_set_num_threads(threads);
#endif
    std::vector<c10::IValue> args;
    for (int32_t i = 0; i < n_positional; i++) args.push_back(to_ivalue(positional[i]));
    torch::jit::Kwargs kwargs;
    for (int32_t i = 0; i < n_keywords; i++) kwargs[names[i]] = to_ivalue(keywords[i]);
    c10::IValue value;
    auto& m = static_cast<Model*>(model)->module;
    if (inference_mode) {
      c10::InferenceMode guard;
      value = m.get_method("forward")(std::move(args), kwargs);
    } else {
      torch::NoGradGuard guard;
      value = m.get_method("forward")(std::move(args), kwargs);
    }
    result = std::make_unique<Result>();
    if (value.isGenericDict()) {
      result->keyed = true;
      for (const auto& entry : value.toGenericDict()) {
        if (!entry.key().isString()) throw std::runtime_error("the model returns a dict whose keys are not strings");
        add_output(*result, entry.key().toStringRef(), entry.value());
      }
    } else if (value.isTuple()) {
      for (const auto& v : value.toTupleRef().elements()) add_output(*result, "", v);
    } else if (value.isList() && !is_strings(value)) {
      for (const auto& v : value.toListRef()) add_output(*result, "", v);
    } else {
      add_output(*result, "", value);
    }
  });
  return ok ? result.release() : nullptr;
}

int32_t fts_result_count(void* result) { return static_cast<int32_t>(static_cast<Result*>(result)->outputs.size()); }

int32_t fts_result_keyed(void* result) { return static_cast<Result*>(result)->keyed ? 1 : 0; }

// Output `index`: its dict key (empty when not keyed), and its tensor or strings, valid until
// the result is freed. 0 when it exists.
int32_t fts_result_output(void* result, int32_t index, const char** key, fts_tensor* out) {
  auto* r = static_cast<Result*>(result);
  if (index < 0 || index >= static_cast<int32_t>(r->outputs.size())) return -1;
  auto& o = r->outputs[index];
  *key = o.key.c_str();
  std::memset(out, 0, sizeof(*out));
  if (o.is_strings) {
    out->is_strings = 1;
    out->count = static_cast<int64_t>(o.strings.size());
    out->strings = o.pointers.data();
    out->lengths = o.lengths.data();
    return 0;
  }
  out->dtype = from_scalar(o.tensor.scalar_type());
  out->ndim = static_cast<int32_t>(o.tensor.dim());
  out->shape = o.tensor.sizes().data();
  out->data = o.tensor.data_ptr();
  out->nbytes = static_cast<int64_t>(o.tensor.nbytes());
  return 0;
}

void fts_result_free(void* result) { delete static_cast<Result*>(result); }

}  // extern "C"
