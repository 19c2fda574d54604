-- Argo CD health check for pdserve.io/PDService (argocd-cm key resource.customizations.health.pdserve.io_PDService).
--
-- It reads the conditions the pdserve operator writes and follows kstatus, the rules Flux and kpt use, so every
-- GitOps tool reaches the same verdict:
--   Healthy      Ready=True (serving, every child up to date), for the generation Argo CD applied
--   Degraded     Stalled=True: the operator cannot progress without a human (invalid spec, a child the API server
--                refused, crash-looping engines, a router Deployment that gave up); the message says which
--   Progressing  anything else: no status yet, a status for an older generation, Reconciling=True (children
--                rolling out, pods pending or pulling images, endpoints not ready)
-- Statuses written by an operator older than the Ready/Reconciling/Stalled conditions fall back to Available,
-- Progressing and Degraded.
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

if obj.status == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the pdserve operator to report status"
  return hs
end

local generation = obj.metadata.generation
local observed = obj.status.observedGeneration
if generation ~= nil and (observed == nil or observed < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the pdserve operator to act on generation " .. generation
  return hs
end

local conditions = obj.status.conditions
local stalled = find(conditions, "Stalled")
local ready = find(conditions, "Ready")
local reconciling = find(conditions, "Reconciling")

if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(stalled)
  return hs
end
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = describe(ready)
  return hs
end
if reconciling ~= nil and reconciling.status == "True" then
  hs.status = "Progressing"
  hs.message = describe(reconciling)
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
