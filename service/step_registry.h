// StepRegistry: the streaming steps open on this replica (docs/design.md
// §18), each its tenant's: keyed by the tenant that opened it and its id, so
// a call from any other tenant that names it gets the answer an unknown id
// gets. Ids that packd chooses carry 128 bits from OpenSSL's generator. A
// thread ends steps past their deadline.
//
// clang-format off
//   PACKD_ASSIGN_OR_RETURN(auto step, registry.Open(tenant, options));
//   PACKD_ASSIGN_OR_RETURN(auto same, registry.Find(submitter, id, StepAccess::kSubmit));
//   registry.Remove(*step);  // the controller's stream is done
// clang-format on
#ifndef PACKD_SERVICE_STEP_REGISTRY_H_
#define PACKD_SERVICE_STEP_REGISTRY_H_

#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "packd/v1/pack_service.pb.h"
#include "service/memory_budget.h"
#include "service/service_core.h"
#include "service/stream_step.h"
#include "service/tenant.h"

namespace packd {

// Who asks for a step: a submitter (the owner, or a tenant it named) or
// the owner's controller and ranks.
enum class StepAccess { kSubmit, kOwner };

// The steps open on this replica. Safe to share across threads; mu_ guards
// the map. A thread ends steps past their deadline.
class StepRegistry {
 public:
  // `budget` counts the groups steps hold; it must outlive every step's
  // groups: call EndAll() before it goes.
  StepRegistry(ServiceCore* core, MemoryBudget* budget);
  ~StepRegistry();

  // Where submitters and receivers reach this replica (--advertise_address,
  // else the address packd listens on). Set once the server listens.
  void SetAddress(std::string address);
  std::string address() const;

  // Opens `owner`'s step; an id packd chooses carries 128 random bits.
  // INVALID_ARGUMENT for options a step cannot take (naming the field),
  // ALREADY_EXISTS for the id of a step `owner` has open here (each tenant's
  // ids are its own).
  absl::StatusOr<std::shared_ptr<StreamingStep>> Open(
      const Tenant& owner, const v1::StepOptions& options);
  // The step `caller` names: its own, or with kSubmit one whose owner named
  // it a submitter. NOT_FOUND, naming this replica, for any other: a step
  // not open here and another tenant's get the same answer.
  absl::StatusOr<std::shared_ptr<StreamingStep>> Find(const Tenant& caller,
                                                      const std::string& id,
                                                      StepAccess access) const;
  // Forgets the step (its memory goes with the last reference).
  void Remove(const StreamingStep& step);
  int64_t open_steps() const;
  // Ends every step (UNAVAILABLE: the server is going) and forgets it.
  void EndAll();

 private:
  void Reap();

  ServiceCore* const core_;
  MemoryBudget* const budget_;
  mutable absl::Mutex mu_;
  std::string address_ ABSL_GUARDED_BY(mu_);
  // By (owner's tenant name, id).
  absl::flat_hash_map<std::pair<std::string, std::string>,
                      std::shared_ptr<StreamingStep>>
      steps_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reaper_;
};

}  // namespace packd

#endif  // PACKD_SERVICE_STEP_REGISTRY_H_
