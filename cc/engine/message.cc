#include "cc/engine/message.h"

#include <cstring>
#include <type_traits>

namespace mpistrategy {

namespace {

constexpr uint32_t kRequestListMagic = 0x4d525134;   // "MRQ4"
constexpr uint32_t kResponseListMagic = 0x4d525334;  // "MRS4"

// Appends fixed-width little-endian-in-memory values.  All ranks run the same
// build on the same architecture, so host byte order is the wire order.
class Writer {
 public:
  explicit Writer(std::string* out) : out_(out) {}

  template <typename T>
  void Put(T value) {
    static_assert(std::is_trivially_copyable<T>::value, "POD only");
    const size_t at = out_->size();
    out_->resize(at + sizeof(T));
    std::memcpy(&(*out_)[at], &value, sizeof(T));
  }
  void PutString(const std::string& s) {
    Put<uint32_t>(static_cast<uint32_t>(s.size()));
    out_->append(s);
  }
  template <typename T>
  void PutVector(const std::vector<T>& v) {
    Put<uint32_t>(static_cast<uint32_t>(v.size()));
    if (v.empty()) return;
    const size_t at = out_->size();
    out_->resize(at + v.size() * sizeof(T));
    std::memcpy(&(*out_)[at], v.data(), v.size() * sizeof(T));
  }

 private:
  std::string* out_;
};

// Reads what Writer wrote; every read is bounds-checked and a failure is
// sticky (later reads fail too), so callers check ok() once at the end.
class Reader {
 public:
  explicit Reader(const std::string& in) : in_(in) {}

  template <typename T>
  bool Get(T* value) {
    if (!ok_ || in_.size() - pos_ < sizeof(T)) return Fail();
    std::memcpy(value, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  bool GetString(std::string* s) {
    uint32_t n = 0;
    if (!Get(&n)) return false;
    if (in_.size() - pos_ < n) return Fail();
    s->assign(in_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  template <typename T>
  bool GetVector(std::vector<T>* v) {
    uint32_t n = 0;
    if (!Get(&n)) return false;
    if ((in_.size() - pos_) / sizeof(T) < n) return Fail();
    v->resize(n);
    if (n > 0) std::memcpy(v->data(), in_.data() + pos_, n * sizeof(T));
    pos_ += static_cast<size_t>(n) * sizeof(T);
    return true;
  }
  // Reads a count of elements that each take at least `min_bytes`, so a
  // corrupt count cannot make the caller reserve absurd amounts of memory.
  bool GetCount(uint32_t* n, size_t min_bytes) {
    if (!Get(n)) return false;
    if ((in_.size() - pos_) / min_bytes < *n) return Fail();
    return true;
  }
  bool Fail() {
    ok_ = false;
    return false;
  }
  bool ok() const { return ok_; }
  bool at_end() const { return pos_ == in_.size(); }

 private:
  const std::string& in_;
  size_t pos_ = 0;
  bool ok_ = true;
};

void WriteShapes(const std::vector<Shape>& shapes, Writer* w) {
  w->Put<uint32_t>(static_cast<uint32_t>(shapes.size()));
  for (const Shape& s : shapes) w->PutVector(s);
}

bool ReadShapes(Reader* r, std::vector<Shape>* shapes) {
  uint32_t n = 0;
  if (!r->GetCount(&n, sizeof(uint32_t))) return false;
  shapes->resize(n);
  for (Shape& s : *shapes) {
    if (!r->GetVector(&s)) return false;
  }
  return true;
}

bool ReadDtypes(Reader* r, std::vector<DataType>* dtypes) {
  if (!r->GetVector(dtypes)) return false;
  for (DataType d : *dtypes) {
    if (!IsValidDataType(d)) return r->Fail();
  }
  return true;
}

template <typename E>
bool GetEnum(Reader* r, E* e, uint8_t max_value) {
  uint8_t v = 0;
  if (!r->Get(&v)) return false;
  if (v > max_value) return r->Fail();
  *e = static_cast<E>(v);
  return true;
}

bool GetBool(Reader* r, bool* b) {
  uint8_t v = 0;
  if (!GetEnum(r, &v, 1)) return false;
  *b = v != 0;
  return true;
}

void WriteRequest(const Request& q, Writer* w) {
  w->Put<int32_t>(q.rank);
  w->Put<uint8_t>(static_cast<uint8_t>(q.type));
  w->PutString(q.name);
  w->Put<uint8_t>(static_cast<uint8_t>(q.dtype));
  w->PutVector(q.shape);
  w->Put<uint8_t>(static_cast<uint8_t>(q.reduce_op));
  w->Put<int32_t>(q.root_rank);
  w->Put<int32_t>(q.device);
  w->PutVector(q.splits);
  WriteShapes(q.packed_shapes, w);
  w->PutVector(q.packed_dtypes);
  w->Put<uint8_t>(q.grouped ? 1 : 0);
  w->PutString(q.invalid);
}

bool ReadRequest(Reader* r, Request* q) {
  return r->Get(&q->rank) &&
         GetEnum(r, &q->type, static_cast<uint8_t>(CollectiveType::kBarrier)) &&
         r->GetString(&q->name) &&
         GetEnum(r, &q->dtype, static_cast<uint8_t>(DataType::kFloat64)) &&
         r->GetVector(&q->shape) &&
         GetEnum(r, &q->reduce_op,
                 static_cast<uint8_t>(ReduceOp::kProduct)) &&
         r->Get(&q->root_rank) && r->Get(&q->device) &&
         r->GetVector(&q->splits) && ReadShapes(r, &q->packed_shapes) &&
         ReadDtypes(r, &q->packed_dtypes) && GetBool(r, &q->grouped) &&
         r->GetString(&q->invalid);
}

void WriteResponse(const Response& p, Writer* w) {
  w->Put<uint8_t>(static_cast<uint8_t>(p.type));
  w->Put<uint32_t>(static_cast<uint32_t>(p.names.size()));
  for (const std::string& n : p.names) w->PutString(n);
  w->Put<uint8_t>(static_cast<uint8_t>(p.dtype));
  w->Put<uint8_t>(static_cast<uint8_t>(p.reduce_op));
  w->Put<int32_t>(p.root_rank);
  w->Put<int32_t>(p.device);
  WriteShapes(p.shapes, w);
  w->PutVector(p.first_dims);
  w->PutVector(p.splits);
  WriteShapes(p.packed_shapes, w);
  w->PutVector(p.packed_dtypes);
  w->Put<int32_t>(static_cast<int32_t>(p.error_code));
  w->PutString(p.error_message);
  w->PutVector(p.error_ranks);
}

bool ReadResponse(Reader* r, Response* p) {
  if (!GetEnum(r, &p->type, static_cast<uint8_t>(ResponseType::kError))) {
    return false;
  }
  uint32_t n = 0;
  if (!r->GetCount(&n, sizeof(uint32_t))) return false;
  p->names.resize(n);
  for (std::string& name : p->names) {
    if (!r->GetString(&name)) return false;
  }
  if (!GetEnum(r, &p->dtype, static_cast<uint8_t>(DataType::kFloat64)) ||
      !GetEnum(r, &p->reduce_op, static_cast<uint8_t>(ReduceOp::kProduct)) ||
      !r->Get(&p->root_rank) || !r->Get(&p->device) ||
      !ReadShapes(r, &p->shapes)) {
    return false;
  }
  int32_t code = 0;
  return r->GetVector(&p->first_dims) && r->GetVector(&p->splits) &&
         ReadShapes(r, &p->packed_shapes) &&
         ReadDtypes(r, &p->packed_dtypes) && r->Get(&code) &&
         (p->error_code = static_cast<StatusCode>(code), true) &&
         r->GetString(&p->error_message) && r->GetVector(&p->error_ranks);
}

Status Malformed(const char* what, size_t size) {
  return Status::Internal(std::string("mpistrategy: malformed ") + what +
                          " (" + std::to_string(size) +
                          " bytes); are all ranks running the same "
                          "mpistrategy build?");
}

}  // namespace

bool Request::operator==(const Request& o) const {
  return rank == o.rank && type == o.type && name == o.name &&
         dtype == o.dtype && shape == o.shape && reduce_op == o.reduce_op &&
         root_rank == o.root_rank && device == o.device && splits == o.splits &&
         packed_shapes == o.packed_shapes && packed_dtypes == o.packed_dtypes &&
         grouped == o.grouped && invalid == o.invalid;
}

bool Response::operator==(const Response& o) const {
  return type == o.type && names == o.names && dtype == o.dtype &&
         reduce_op == o.reduce_op && root_rank == o.root_rank &&
         device == o.device && shapes == o.shapes &&
         first_dims == o.first_dims && splits == o.splits &&
         packed_shapes == o.packed_shapes &&
         packed_dtypes == o.packed_dtypes && error_code == o.error_code &&
         error_message == o.error_message &&
         error_ranks == o.error_ranks;
}

ResponseType ToResponseType(CollectiveType type) {
  return static_cast<ResponseType>(static_cast<uint8_t>(type));
}

CollectiveType ToCollectiveType(ResponseType type) {
  return static_cast<CollectiveType>(static_cast<uint8_t>(type));
}

const char* ResponseTypeName(ResponseType type) {
  if (type == ResponseType::kError) return "error";
  return CollectiveTypeName(ToCollectiveType(type));
}

void SerializeRequestList(const RequestList& list, std::string* out) {
  out->clear();
  Writer w(out);
  w.Put<uint32_t>(kRequestListMagic);
  w.Put<uint8_t>(list.shutdown ? 1 : 0);
  w.PutString(list.shutdown_reason);
  w.Put<uint32_t>(static_cast<uint32_t>(list.requests.size()));
  for (const Request& q : list.requests) WriteRequest(q, &w);
}

Status ParseRequestList(const std::string& bytes, RequestList* list) {
  Reader r(bytes);
  uint32_t magic = 0;
  uint8_t shutdown = 0;
  uint32_t n = 0;
  *list = RequestList();
  if (!r.Get(&magic) || magic != kRequestListMagic || !r.Get(&shutdown) ||
      !r.GetString(&list->shutdown_reason) || !r.GetCount(&n, 16)) {
    return Malformed("request list", bytes.size());
  }
  list->shutdown = shutdown != 0;
  list->requests.resize(n);
  for (Request& q : list->requests) {
    if (!ReadRequest(&r, &q)) return Malformed("request list", bytes.size());
  }
  if (!r.at_end()) return Malformed("request list", bytes.size());
  return Status::Ok();
}

void SerializeResponseList(const ResponseList& list, std::string* out) {
  out->clear();
  Writer w(out);
  w.Put<uint32_t>(kResponseListMagic);
  w.Put<uint8_t>(list.shutdown ? 1 : 0);
  w.Put<int32_t>(list.shutdown_rank);
  w.PutString(list.shutdown_reason);
  w.Put<uint8_t>(list.has_parameters ? 1 : 0);
  if (list.has_parameters) {
    w.Put<int64_t>(list.parameters.fusion_threshold_bytes);
    w.Put<double>(list.parameters.fusion_wait_ms);
    w.Put<uint8_t>(list.parameters.final ? 1 : 0);
  }
  w.Put<uint32_t>(static_cast<uint32_t>(list.responses.size()));
  for (const Response& p : list.responses) WriteResponse(p, &w);
}

Status ParseResponseList(const std::string& bytes, ResponseList* list) {
  Reader r(bytes);
  uint32_t magic = 0;
  uint8_t shutdown = 0;
  uint32_t n = 0;
  *list = ResponseList();
  uint8_t has_parameters = 0;
  if (!r.Get(&magic) || magic != kResponseListMagic || !r.Get(&shutdown) ||
      !r.Get(&list->shutdown_rank) || !r.GetString(&list->shutdown_reason) ||
      !r.Get(&has_parameters) || has_parameters > 1) {
    return Malformed("response list", bytes.size());
  }
  list->shutdown = shutdown != 0;
  list->has_parameters = has_parameters != 0;
  if (list->has_parameters) {
    uint8_t final = 0;
    if (!r.Get(&list->parameters.fusion_threshold_bytes) ||
        !r.Get(&list->parameters.fusion_wait_ms) || !r.Get(&final) ||
        final > 1 || list->parameters.fusion_threshold_bytes < 0 ||
        !(list->parameters.fusion_wait_ms >= 0.0)) {
      return Malformed("response list", bytes.size());
    }
    list->parameters.final = final != 0;
  }
  if (!r.GetCount(&n, 16)) return Malformed("response list", bytes.size());
  list->responses.resize(n);
  for (Response& p : list->responses) {
    if (!ReadResponse(&r, &p)) return Malformed("response list", bytes.size());
  }
  if (!r.at_end()) return Malformed("response list", bytes.size());
  return Status::Ok();
}

void AllgatherLayout(const Response& response, int world_size,
                     std::vector<int64_t>* bytes_per_rank, int64_t* rows,
                     int64_t* total_bytes) {
  const int64_t row_bytes =
      RowElements(response.shapes[0]) * DataTypeSize(response.dtype);
  bytes_per_rank->resize(world_size);
  *rows = 0;
  *total_bytes = 0;
  for (int r = 0; r < world_size; ++r) {
    *rows += response.first_dims[r];
    (*bytes_per_rank)[r] = response.first_dims[r] * row_bytes;
    *total_bytes += (*bytes_per_rank)[r];
  }
}

}  // namespace mpistrategy
