-- Argo CD health check for pdserve.io/PDService (argocd-cm key resource.customizations.health.pdserve.io_PDService).
--
-- It gives kstatus' verdict (sigs.k8s.io/cli-utils pkg/kstatus, what Flux and kpt use), step for step, so every
-- GitOps tool agrees on a PDService:
--   1. being deleted (metadata.deletionTimestamp)         -> Progressing (kstatus: Terminating)
--   2. status.observedGeneration differs from the object's metadata.generation (both present)
--                                                          -> Progressing (InProgress)
--   3. the first condition, in list order, that is Reconciling=True or Stalled=True
--                                                          -> Progressing (InProgress) or Degraded (Failed)
--   4. otherwise Ready=True                                -> Healthy (Current)
-- Ready=True never outweighs Reconciling=True or Stalled=True, whatever else the status says.
-- Only where kstatus finds nothing to go on (no status, or no Ready=True and none of the above) does this script
-- differ: kstatus answers Current there, its rule for kinds it does not know; this script waits for Ready=True
-- (Progressing), as the Flux healthCheckExprs in gitops/README.md do. The pdserve operator always writes exactly
-- one of Ready, Reconciling and Stalled True, so only "no status yet" reaches that case in practice.
-- Statuses from an operator older than the Ready/Reconciling/Stalled conditions fall back to Available,
-- Progressing and Degraded (again only where kstatus has no verdict of its own).
-- tests/gitops/test_argocd_health.py checks all of this against the real kstatus, every combination.
local hs = {}

local function find(conditions, wanted)
  if conditions == nil then
    return nil
  end
  for _, condition in ipairs(conditions) do
    if condition.type == wanted then
      return condition
    end
  end
  return nil
end

local function describe(condition)
  local reason = condition.reason or condition.type
  if condition.message ~= nil and condition.message ~= "" then
    return reason .. ": " .. condition.message
  end
  return reason
end

-- 1. Argo CD reports an object being deleted as Progressing before it runs a health script; kstatus does the same.
if obj.metadata ~= nil and obj.metadata.deletionTimestamp ~= nil and obj.metadata.deletionTimestamp ~= "" then
  hs.status = "Progressing"
  hs.message = "Pending deletion"
  return hs
end

if obj.status == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the pdserve operator to report status"
  return hs
end

-- 2. A status written for another generation says nothing about this one (kstatus compares only when both exist).
local generation = obj.metadata and obj.metadata.generation
local observed = obj.status.observedGeneration
if generation ~= nil and observed ~= nil and observed ~= generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the pdserve operator to act on generation " .. generation
  return hs
end

-- 3. Reconciling and Stalled, in the order the status lists them: the first True one decides.
local conditions = obj.status.conditions
if conditions ~= nil then
  for _, condition in ipairs(conditions) do
    if condition.status == "True" and condition.type == "Reconciling" then
      hs.status = "Progressing"
      hs.message = describe(condition)
      return hs
    end
    if condition.status == "True" and condition.type == "Stalled" then
      hs.status = "Degraded"
      hs.message = describe(condition)
      return hs
    end
  end
end

-- 4. Nothing in progress and nothing stalled.
local ready = find(conditions, "Ready")
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = describe(ready)
  return hs
end

if ready == nil then
  -- An operator from before the kstatus conditions.
  local available = find(conditions, "Available")
  local progressing = find(conditions, "Progressing")
  local degraded = find(conditions, "Degraded")
  if degraded ~= nil and degraded.status == "True"
    and (degraded.reason == "InvalidSpec" or degraded.reason == "ApplyFailed") then
    hs.status = "Degraded"
    hs.message = describe(degraded)
    return hs
  end
  if available ~= nil and available.status == "True"
    and (progressing == nil or progressing.status ~= "True")
    and (degraded == nil or degraded.status ~= "True") then
    hs.status = "Healthy"
    hs.message = describe(available)
    return hs
  end
end

hs.status = "Progressing"
if ready ~= nil then
  hs.message = describe(ready)
else
  hs.message = "Waiting for the PDService to become ready"
end
return hs
