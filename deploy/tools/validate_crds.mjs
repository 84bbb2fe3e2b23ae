// Validates the chart's custom resources (ServiceMonitor, KEDA ScaledObject), which the
// Kubernetes schemas of kubernetes-validate do not cover, against the models generated
// from their CRDs (@kubernetes-models, installed into .tools/npm by install.sh): types,
// required fields, enums. Reads a JSON array of manifests on stdin; prints one line per
// invalid object and exits 1 if there is any.
//   node deploy/tools/validate_crds.mjs < manifests.json
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";
import { ScaledObject } from "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject";

const MODELS = {
  "monitoring.coreos.com/v1/ServiceMonitor": ServiceMonitor,
  "keda.sh/v1alpha1/ScaledObject": ScaledObject,
};

let input = "";
for await (const chunk of process.stdin) input += chunk;
let failures = 0;
for (const doc of JSON.parse(input)) {
  const key = `${doc.apiVersion}/${doc.kind}`;
  const Model = MODELS[key];
  if (!Model) {
    console.log(`${key} ${doc.metadata?.name}: no model to validate against`);
    failures++;
    continue;
  }
  try {
    new Model(doc).validate();
    console.log(`${key} ${doc.metadata.name}: valid`);
  } catch (err) {
    console.log(`${key} ${doc.metadata?.name}: ${err.message}`);
    failures++;
  }
}
process.exit(failures ? 1 : 0);
