-- Upper confidence bound on a share, prepended to personal.lua for the bounded budget:
-- the largest q >= x = count/n with n KL(x || q) <= ln(1/level), KL the Bernoulli
-- relative entropy, by 64 halvings of [x, 1] (the spacing of doubles). Chernoff's bound
-- makes it at least the one-sided Clopper-Pearson bound; service.core.guarantees.
-- share_upper_bound is the same bisection, and tests/test_budget.py checks both against
-- scipy's beta quantile.
local function share_upper_bound(count, n, level)
  if n <= 0 or count >= n then return 1 end
  local x = count / n
  local target = math.log(1 / level)
  local low, high = x, 1
  for _ = 1, 64 do
    local q = (low + high) / 2
    local entropy = (1 - x) * math.log((1 - x) / (1 - q))
    if x > 0 then entropy = entropy + x * math.log(x / q) end
    if n * entropy > target then high = q else low = q end
  end
  return high
end
